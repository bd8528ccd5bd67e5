"""A fake plugin: one available backend that outranks cpu, and one that is never available."""

from dinfer_rt.backends.cpu.backend import CpuBackend

from dinfer_rt.backend import Availability
from dinfer_rt.plugins import hookimpl


class FastFake(CpuBackend):
    name = "fastfake"
    flavour = "fake"
    priority = 10


class MissingChip(CpuBackend):
    name = "missingchip"
    priority = 20

    def is_available(self):
        return Availability(False, "libmissing.so not found")


@hookimpl
def dinfer_rt_register_backends():
    return [FastFake, MissingChip]
