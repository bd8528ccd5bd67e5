"""A backend whose ``is_available`` returns a bare ``True`` instead of an ``Availability``."""

from dinfer_rt.backend import Backend
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


class BoolChip(Backend):
    name = "boolchip"
    priority = -3

    def is_available(self):
        return True  # wrong: must be Availability(True, reason)


@hookimpl
def dinfer_rt_register_backends():
    return [BoolChip]
