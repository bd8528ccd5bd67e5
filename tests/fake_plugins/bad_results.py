"""A plugin whose hooks return the wrong types: each is that plugin's recorded fault."""

from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


@hookimpl
def dinfer_rt_register_kernels(backend_name):
    return ["not", "a", "kernel table"]


@hookimpl
def dinfer_rt_launch_config(backend_name, arch):
    return 5


@hookimpl
def dinfer_rt_register_backends():
    return object  # not a list of Backend classes
