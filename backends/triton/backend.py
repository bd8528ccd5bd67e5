"""``TritonBackend``: what every backend that runs the shared Triton kernels has in common.

A device folder (``cuda/``, ``rocm_dcu/``) subclasses it with its probe, capabilities, tuning
rows and detection; kernels, host wrappers, launch functions, autotuning and device graphs all
live here. ``DINFER_INTERPRET=1`` runs the kernels on CPU tensors under ``TRITON_INTERPRET=1``:
how every kernel is checked on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping

import torch

from dinfer_rt import envs
from dinfer_rt.backend import Backend
from dinfer_rt.errors import BackendError
from dinfer_rt.executor import Executable, Kernel


def interpreting() -> bool:
    return envs.flag(envs.DINFER_INTERPRET)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


class TritonBackend(Backend):
    """A backend whose kernels are the shared Triton kernels with one tuning row per arch.

    Subclasses implement :meth:`tuning` (this arch's row) and the platform part."""

    device_type = "cuda"

    def __init__(self) -> None:
        if interpreting():
            self.device_type = "cpu"

    def tuning(self) -> dict:
        """This arch's tuning row (see ``backends/triton/launch.py`` for the keys)."""
        raise NotImplementedError

    def emulation(self) -> str | None:
        return "Triton's interpreter on the CPU (DINFER_INTERPRET=1)" if interpreting() else None

    def kernels(self) -> Mapping[str, Kernel]:
        """The shared Triton kernels for this arch's row, or none without triton. In interpreter
        mode, checks that triton was imported after TRITON_INTERPRET=1 was set. With
        DINFER_AUTOTUNE=1 an on-disk autotuner keyed by arch and versions is attached."""
        if not triton_installed():
            return {}
        if interpreting():
            _check_interpreter(self.name)
        from dinfer_rt.backends.triton.ops import make_kernels

        tuner = None
        if envs.flag(envs.DINFER_AUTOTUNE):
            from dinfer_rt import __version__
            from dinfer_rt.backends.triton.autotune import Autotuner

            sync = (lambda: None) if interpreting() else torch.cuda.synchronize
            tuner = Autotuner(self.arch or "unknown", {**self.versions(), "dinfer_rt": __version__}, sync=sync)
        return make_kernels(self.tuning(), interpreting(), self.launch_config, tuner)

    def commit_kernel(self) -> Callable | None:
        """The shared Triton commit kernel, one program per row; None without triton."""
        if not triton_installed():
            return None
        from dinfer_rt.backends.triton.ops import commit

        return commit

    def edit_kernel(self) -> Callable | None:
        """The shared Triton step of the editing rule (``commit_edit_kernel``), one program per
        row; None without triton."""
        if not triton_installed():
            return None
        from dinfer_rt.backends.triton.ops import commit_edit

        return commit_edit

    def default_launch_config(self, kernel: str) -> dict:
        from dinfer_rt.backends.triton.launch import default_config

        return default_config(kernel, self.tuning())

    def replays_graphs(self) -> bool:
        return envs.flag(envs.DINFER_GRAPHS) and not interpreting()

    def compile(self, graph, weights) -> Executable:
        """With DINFER_GRAPHS=1 on a device, forwards replay captured device graphs per shape."""
        exe = super().compile(graph, weights)
        if self.replays_graphs():
            from dinfer_rt.backends.triton.graphs import GraphedExecutable

            return GraphedExecutable(exe)
        return exe


def _check_interpreter(backend: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernels module is imported
    # numpy warns about NaN in padding lanes (-inf - -inf) that the kernels never store
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    import triton.language as tl

    if type(tl.sum).__name__ != "InterpretedFunction":
        raise BackendError(
            f"{backend}: DINFER_INTERPRET=1 but triton was imported before TRITON_INTERPRET=1 was set; "
            "set DINFER_INTERPRET=1 (or TRITON_INTERPRET=1) in the environment before starting Python"
        )
