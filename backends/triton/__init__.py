"""The shared Triton library: kernel source (``kernels.py``), launch functions (``launch.py``),
host wrappers (``ops.py``), autotuning (``autotune.py``), ahead-of-time builds (``aot.py``),
device graphs (``graphs.py``) and the ``TritonBackend`` base (``backend.py``). Device folders
(``cuda/``, ``rocm_dcu/``, ``ascend/``) hold only probes, capabilities, tuning rows and detection."""
