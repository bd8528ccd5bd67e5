"""A plugin registering a backend named ``cpu`` (taken by the built-in) beside one of its own."""

from dinfer_rt.backend import Backend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


class ClashCpu(Backend):
    name = "cpu"


class OwnChip(Backend):
    name = "ownchip"
    priority = -3


@hookimpl
def dinfer_rt_register_backends():
    return [ClashCpu, OwnChip]
