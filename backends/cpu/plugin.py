"""Entry point of the ``cpu`` backend (group ``dinfer_rt.backends``), like any plugin."""

from dinfer_rt.backends.cpu.backend import CpuBackend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


@hookimpl
def dinfer_rt_register_backends():
    return [CpuBackend]
