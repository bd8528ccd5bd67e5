"""The CPU reference backend: runs every IR op's reference semantics with torch."""

from dinfer_rt.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
