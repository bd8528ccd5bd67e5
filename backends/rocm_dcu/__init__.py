"""Hygon DCU / AMD ROCm backend (``rocm_dcu``): the HIP build of torch, device type ``cuda``.
Kernels are the next step (issue "Hygon DCU backend"); until then every op runs through
the reference fallback on the device."""
