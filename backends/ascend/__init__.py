"""Huawei Ascend 910B backend (``ascend``) through torch_npu / CANN. Lowering to fused
``torch_npu.npu_*`` operators is the next step (issue "Ascend 910B backend")."""
