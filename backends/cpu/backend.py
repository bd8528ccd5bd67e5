"""The ``cpu`` backend: the fast path on the host.

Ops whose cost on small models is dispatch, not arithmetic, run natively (``native.py``: norms,
SwiGLU, attention, whole layer blocks) when a C compiler is there; the others run their
reference semantics in torch. Like every backend it is validated against the ``reference``
backend (``backends/reference``: the float64 oracle, which no native code touches).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping

import torch

from dinfer_rt import envs
from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.backends.cpu import blas, native
from dinfer_rt.backends.cpu import kernels as cpu_kernels
from dinfer_rt.errors import ConfigError
from dinfer_rt.executor import Kernel
from dinfer_rt.ir import OPS


def host_archs() -> tuple[str, ...]:
    """The names this host's CPU arch goes by (``cpu:native:x86`` on an x86-64 host)."""
    machine = platform.machine().lower()
    for family in (("x86_64", "x86", "amd64", "x64"), ("aarch64", "arm64")):
        if machine in family:
            return family
    return (machine,) if machine else ()


class CpuBackend(Backend):
    name = "cpu"
    flavour = "native"  # device_type: "cpu", the Platform default
    priority = 0

    def __init__(self) -> None:
        # Read when the backend is chosen (one model, one setting), checked when it compiles.
        self.matmul_setting = os.environ.get(envs.DINFER_CPU_MATMUL)

    def matmul_precision(self) -> str:
        """``DINFER_CPU_MATMUL`` as it was when this backend was selected (``fp32`` / ``bf16``)."""
        return native.parse_matmul(self.matmul_setting)

    def is_available(self) -> Availability:
        threads = f"torch {torch.__version__} on the CPU, {torch.get_num_threads()} threads"
        return Availability(True, f"{threads}; native kernels {native.load().reason}")

    def validate_choice(self) -> str | None:
        """The cpu backend has one flavour (subclasses: their own class default); an arch, if
        named, must be this host's (nothing else could run here)."""
        return self.choice_problem((type(self).flavour,), host_archs())

    def capabilities(self) -> Capabilities:
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        extra = {"native_gemms": native.gemm_status()}  # on, or off and why (e.g. a BLAS that failed its check)
        return Capabilities(dtypes=dtypes, collectives="gloo", weight_formats=("int8", "fp8", "gptq4"), extra=extra)

    def commit_kernel(self):
        """The scheduler's greedy commit (threshold / top-k) in one native call where native.c
        is built: a step then spends no torch ops on its decision (``NativeKernels.commit``)."""
        lib = native.load().lib
        return None if lib is None else native.NativeKernels(lib).commit

    def kernels(self) -> Mapping[str, Kernel]:
        kernels = {name: op.reference for name, op in OPS.items()}
        # The fused op whose point is memory: never build [positions x vocab] probabilities.
        kernels["lm_head_confidence"] = cpu_kernels.lm_head_confidence_budgeted
        # Same semantics, less work per forward (angles and mask once per forward, not per layer;
        # float32 norms, SwiGLU and rotary + K/V writes in one native call each where native.c is built).
        lib = native.load().lib
        matmul = self.matmul_precision()
        if matmul == "bf16" and (why := native.bf16_unavailable(lib)):
            raise ConfigError(f"backend cpu: {envs.DINFER_CPU_MATMUL}=bf16 cannot run here: {why}")
        if lib is not None and envs.get(envs.DINFER_CPU_BLAS) is not None:  # a BLAS the user named must run
            if (found := blas.checked(lib._name)).sgemm is None:
                raise ConfigError(f"backend cpu: {found.reason}; unset {envs.DINFER_CPU_BLAS} to use torch's own BLAS")
        fast = native.NativeKernels(lib, matmul) if lib is not None else None
        attn = cpu_kernels.AttentionKernels(fast)  # one per compiled executable: its memos are its own
        kernels |= {
            "attention": attn.attention,
            "rope_attention": attn.rope_attention,
            "rms_norm": cpu_kernels.rms_norm,
            "add_rms_norm": cpu_kernels.add_rms_norm,
            "linear_wq": cpu_kernels.linear_wq,
        }
        # The layer blocks (a dense layer in two native calls) only where native.c and a BLAS are
        # there: without them the fusion passes leave the layer's ops apart.
        del kernels["attention_block"], kernels["mlp_block"]
        if fast is not None:
            rows = cpu_kernels.NativeRowKernels(fast)
            kernels |= {"rms_norm": rows.rms_norm, "add_rms_norm": rows.add_rms_norm, "swiglu": rows.swiglu}
            kernels |= {"linear": rows.linear, "lm_head_confidence": rows.lm_head_confidence}
            if fast.blas is not None:
                blocks = cpu_kernels.LayerBlockKernels(attn, rows)
                kernels |= {"attention_block": blocks.attention_block, "mlp_block": blocks.mlp_block}
        return kernels
