"""Backends whose one kernel raises, or returns the wrong shape, on every call: ``validate`` must
record a named failure for each check and still write its report."""

from dinfer_rt.backend import Backend
from dinfer_rt.ir import ops
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


def rms_norm_raises(x, weight, *, eps):
    raise RuntimeError("planted rms_norm fault")


def add_cuts_a_column(a, b):
    return ops.add(a, b)[..., :-1]


class RaiseChip(Backend):
    """Every op on the reference fallback except a raising rms_norm (no fused kernels: no fusion
    hides it)."""

    name = "raisechip"
    priority = -3

    def kernels(self):
        return {"rms_norm": rms_norm_raises}


class ShapeChip(Backend):
    name = "shapechip"
    priority = -3

    def kernels(self):
        return {"add": add_cuts_a_column}


@hookimpl
def dinfer_rt_register_backends():
    return [RaiseChip, ShapeChip]
