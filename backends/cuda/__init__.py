"""NVIDIA backend (``cuda``): the shared Triton kernels (``dinfer_rt.backends.triton``) with
NVIDIA's probe, capabilities and tuning rows; ptxas-based ahead-of-time builds."""
