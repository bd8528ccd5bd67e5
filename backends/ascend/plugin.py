"""Entry point of the ``ascend`` backend.

The probe never imports torch_npu into this process (torch_npu initialises once per process;
docs/backends/ascend.md): it checks that torch_npu is installed and that CANN's runtime libraries
can be found, and names what is missing.
"""

from __future__ import annotations

import ctypes.util
import functools
import importlib.util
import logging
import os
from pathlib import Path

import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.envs import DINFER_GRAPHS, DINFER_INTERPRET, flag
from dinfer_rt.errors import BackendError
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2

CANN_HOME_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def find_cann_library(name: str = "hccl") -> str | None:
    """Path of lib<name>.so from CANN's env vars, LD_LIBRARY_PATH or the loader cache."""
    for var in CANN_HOME_VARS:
        home = os.environ.get(var)
        if home:
            for sub in ("lib64", "fwkacllib/lib64", "runtime/lib64"):
                p = Path(home) / sub / f"lib{name}.so"
                if p.is_file():
                    return str(p)
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d and (Path(d) / f"lib{name}.so").is_file():
            return str(Path(d) / f"lib{name}.so")
    return ctypes.util.find_library(name)


class AscendBackend(Backend):
    name = "ascend"
    flavour = "910b"
    device_type = "npu"
    priority = 20

    def is_available(self) -> Availability:
        if importlib.util.find_spec("torch_npu") is None:
            return Availability(False, "torch_npu is not installed")
        if find_cann_library("hccl") is None:
            return Availability(
                False,
                "torch_npu is installed but cannot import without CANN: libhccl.so not found "
                "(source CANN's set_env.sh so ASCEND_HOME_PATH / LD_LIBRARY_PATH point to it)",
            )
        return Availability(True, "torch_npu and CANN found (devices are counted after selection)")

    # Ascend 910B1/B2 (published, unconfirmed): 24 AI (cube) cores, 48 vector cores, 192 KB UB.
    AI_CORES, VECTOR_CORES = 24, 48
    # Fusions that pay on this chip (vllm-ascend's passes; docs/backends/ascend.md), each backed by a fused
    # operator: add+RMSNorm (npu_add_rms_norm), gate/up merge + SwiGLU (npu_swiglu). The others
    # (QKV merge, RoPE folded into attention, routing folded into MoE, LM head + confidence) have
    # no operator here and stay off.
    FUSIONS = ("add_rms_norm", "merge_gate_up")

    def validate_choice(self) -> str | None:
        """One flavour (910B: the core counts and fusions here are its) and no arch."""
        return self.choice_problem((type(self).flavour,))

    def __init__(self) -> None:
        self.constraint_fallbacks: dict[str, int] = {}
        self._warned: set[str] = set()

    def capabilities(self) -> Capabilities:
        # fp32 attention goes to npu_fusion_attention (npu_fused_infer_attention_score rejects fp32)
        extra = {
            "ai_cores": self.AI_CORES,
            "vector_cores": self.VECTOR_CORES,
            "unified_buffer_bytes": 192 * 1024,
            "graph_capture": "ACL graph via torch.npu.NPUGraph with DINFER_GRAPHS=1 (unverified on hardware)",
            "alignment_bytes": 32,
        }
        dtypes = (torch.float32, torch.bfloat16, torch.float16)
        # int8 through npu_weight_quant_batchmatmul; Atlas A2 (910B) has no fp8 (docs/backends/ascend.md)
        return Capabilities(dtypes=dtypes, collectives="hccl", extra=extra, weight_formats=("int8", "gptq4"))

    def kernels(self):
        """torch_npu fused operators for the ops that have one (imported here, after selection,
        once: importing registers the ``npu`` device), plus the shared Triton confidence kernel
        under Ascend's launch rules (``launch.py``)."""
        if not (av := self.is_available()):  # unselected (ir --backend ascend): never import torch_npu here
            raise BackendError(f"ascend: its kernels are torch_npu operators, unavailable here: {av.reason}")
        import torch_npu

        from dinfer_rt.backends.ascend.ops import make_kernels

        return make_kernels(torch_npu, self._constraint_fallback, self.VECTOR_CORES, flag(DINFER_INTERPRET))

    def replays_graphs(self) -> bool:
        return flag(DINFER_GRAPHS) and self.device_type == "npu"

    def compile(self, graph, weights):
        """With DINFER_GRAPHS=1, forwards replay ACL graphs captured per shape (torch.npu.NPUGraph)."""
        exe = super().compile(graph, weights)
        if self.replays_graphs():
            from dinfer_rt.backends.triton.graphs import GraphAPI, GraphedExecutable

            return GraphedExecutable(exe, GraphAPI("npu"))
        return exe

    def commit_kernel(self):
        """The shared Triton commit kernel, persistent over the vector cores, where a Triton that
        runs it exists (triton-ascend, or the interpreter); else None and the scheduler decides
        on the host."""
        from dinfer_rt.backends.ascend.ops import triton_usable

        if not triton_usable(flag(DINFER_INTERPRET)):
            return None
        from dinfer_rt.backends.ascend.launch import commit_launch
        from dinfer_rt.backends.triton.ops import commit

        return functools.partial(commit, **commit_launch(self.VECTOR_CORES))

    def edit_kernel(self):
        """The editing rule's step (joint_threshold, greedy): the shared Triton
        ``commit_edit_kernel``, persistent over the vector cores, where a Triton that runs it
        exists; else the reference's torch ``commit_edit`` on the device (no torch_npu op, no
        host sync)."""
        from dinfer_rt.backends.ascend.ops import triton_usable

        if not triton_usable(flag(DINFER_INTERPRET)):
            from dinfer_rt.backends.reference.backend import commit_edit

            return commit_edit
        from dinfer_rt.backends.ascend.launch import commit_launch
        from dinfer_rt.backends.triton.ops import commit_edit

        return functools.partial(commit_edit, **commit_launch(self.VECTOR_CORES))

    def _constraint_fallback(self, op: str, reason: str) -> None:
        self.constraint_fallbacks[op] = self.constraint_fallbacks.get(op, 0) + 1
        if op not in self._warned:
            self._warned.add(op)
            logging.getLogger("dinfer_rt.ascend").warning("ascend: %s runs the reference: %s", op, reason)

    def wants_fusion(self, pass_name: str) -> bool:
        return pass_name in self.FUSIONS

    def emulation(self) -> str | None:
        import sys

        npu = sys.modules.get("torch_npu")
        if npu is not None and getattr(npu, "__version__", None) == "simulated":
            return "a simulated torch_npu on the CPU (dinfer_rt.testing.simulated_torch_npu)"
        return None

    def versions(self) -> dict[str, str]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            npu = version("torch_npu")
        except PackageNotFoundError:
            npu = "not installed"
        return {"torch": torch.__version__, "torch_npu": npu}


@hookimpl
def dinfer_rt_register_backends():
    return [AscendBackend]
