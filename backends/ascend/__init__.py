"""Huawei Ascend 910B backend (``ascend``): IR ops lowered to torch_npu / CANN fused operators
(``ops.py``), the shared Triton kernels under Ascend's launch rules (``launch.py``) through
triton-ascend, ACL graphs through the shared device-graph code."""
