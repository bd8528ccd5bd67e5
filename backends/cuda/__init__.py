"""NVIDIA backend (``cuda``). Triton kernels are the next step (issue "CUDA backend"); until
then every IR op runs through the declared fallback: the reference torch implementation on
CUDA tensors, counted and shown by ``dinfer-rt ir --backend cuda``."""
