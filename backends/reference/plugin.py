"""Entry point of the ``reference`` backend (group ``dinfer_rt.backends``), like any plugin."""

from dinfer_rt.backends.reference.backend import ReferenceBackend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


@hookimpl
def dinfer_rt_register_backends():
    return [ReferenceBackend]
