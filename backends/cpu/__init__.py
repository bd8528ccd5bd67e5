"""The ``cpu`` backend: native row kernels and layer blocks, torch for the rest."""

from dinfer_rt.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
