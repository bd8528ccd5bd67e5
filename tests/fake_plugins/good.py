"""A fake plugin implementing every hook: backends (one outranking cpu, one never available,
one with a partial kernel table), extra kernels for its own backend, and environment info."""

import torch.nn.functional as F

from dinfer_rt.backend import Availability, Backend
from dinfer_rt.backends.cpu.backend import CpuBackend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2

CALLS = {"silu": 0, "rms_norm": 0}


class FastFake(CpuBackend):
    name = "fastfake"
    flavour = "fake"
    priority = 10


class MissingChip(CpuBackend):
    name = "missingchip"
    priority = 20

    def is_available(self):
        return Availability(False, "libmissing.so not found")


def counting_silu(x):
    CALLS["silu"] += 1
    return F.silu(x)


class PartialChip(Backend):
    """Only a silu kernel of its own: every other op must go through the declared fallback."""

    name = "partialchip"
    priority = -1

    def kernels(self):
        return {"silu": counting_silu}


class FlavouredChip(CpuBackend):
    """Available only in its 'real' flavour: a choice naming another flavour must be refused."""

    name = "flavouredchip"
    flavour = "real"
    priority = -2

    def validate_choice(self):  # any flavour may be named; only 'real' is available
        return None

    def is_available(self):
        if self.flavour != "real":
            return Availability(False, f"flavour {self.flavour} has no driver here")
        return Availability(True, "real flavour")


@hookimpl
def dinfer_rt_register_backends():
    return [FastFake, MissingChip, PartialChip, FlavouredChip]


@hookimpl
def dinfer_rt_register_kernels(backend_name):
    if backend_name != "partialchip":
        return None
    from dinfer_rt.ir.ops import rms_norm

    def counting_rms_norm(x, weight, *, eps):
        CALLS["rms_norm"] += 1
        return rms_norm(x, weight, eps=eps)

    return {"rms_norm": counting_rms_norm}


@hookimpl
def dinfer_rt_env_info():
    return {"fakechip driver": "1.2.3"}


@hookimpl
def dinfer_rt_register_passes(backend_name):
    """A backend-specific pass for partialchip: counts the attention nodes it sees."""
    if backend_name != "partialchip":
        return None
    from dinfer_rt.passes import Pass

    return [Pass("count_attention", "reorder", lambda graph, ctx: graph.op_counts().get("attention", 0))]


@hookimpl
def dinfer_rt_launch_config(backend_name, arch):
    """Tunes partialchip's rms_norm for arch 'v2' only."""
    if backend_name == "partialchip" and arch == "v2":
        return {"rms_norm": {"block_size": 256, "num_warps": 8}}
    return None
