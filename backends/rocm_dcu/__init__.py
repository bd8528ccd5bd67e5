"""Hygon DCU / AMD ROCm backend (``rocm_dcu``): the HIP build of torch (device type ``cuda``)
running the shared Triton kernels with wave64 tuning rows; arch detection in ``detect.py``."""
