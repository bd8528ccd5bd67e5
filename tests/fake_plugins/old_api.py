"""A plugin built for an older hook API: refused at load, naming both versions."""

from dinfer_rt.backends.cpu import CpuBackend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 1


class OldChip(CpuBackend):
    name = "oldchip"


@hookimpl
def dinfer_rt_register_backends():
    return [OldChip]
