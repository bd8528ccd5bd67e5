"""Malformed kernel tables and launch tables, from ``Backend.kernels()`` and from the hooks: each
is refused once where it is collected, naming the backend or plugin, the hook or method and why."""

import torch.nn.functional as F

from dinfer_rt.backend import Backend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


def silu(x):
    return F.silu(x)


class ListChip(Backend):
    name = "listchip"
    priority = -3

    def kernels(self):
        return [silu]  # a list, not {ir_op: kernel}


class IntChip(Backend):
    name = "intchip"
    priority = -3

    def kernels(self):
        return {"silu": silu, "rms_norm": 42}


class TypoChip(Backend):
    name = "typochip"
    priority = -3

    def kernels(self):
        return {"silu": silu, "rms_nrom": silu}  # misspelt op: rms_norm would quietly fall back


def _plain(backend_name):
    class Plain(Backend):
        priority = -3

    Plain.name = backend_name
    return Plain


HOOKED = ("hook_nonfn", "hook_typo", "hook_launch", "hook_passes")


@hookimpl
def dinfer_rt_register_backends():
    return [ListChip, IntChip, TypoChip, *(_plain(n) for n in HOOKED)]


@hookimpl
def dinfer_rt_register_kernels(backend_name):
    if backend_name == "hook_nonfn":
        return {"rms_norm": 42}
    if backend_name == "hook_typo":
        return {"sillu": silu}
    return None


@hookimpl
def dinfer_rt_launch_config(backend_name):
    return {"rms_norm": 5} if backend_name == "hook_launch" else None


@hookimpl
def dinfer_rt_register_passes(backend_name):
    return ["not a pass"] if backend_name == "hook_passes" else None
