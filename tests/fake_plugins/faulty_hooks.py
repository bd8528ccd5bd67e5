"""A plugin whose every contribution hook raises: it must be recorded and reported, its
contributions dropped, and every backend keep working."""

from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


@hookimpl
def dinfer_rt_register_kernels(backend_name):
    raise RuntimeError("kernel table broken")


@hookimpl
def dinfer_rt_register_passes(backend_name):
    raise RuntimeError("pass list broken")


@hookimpl
def dinfer_rt_launch_config(backend_name, arch):
    raise RuntimeError("launch table broken")


@hookimpl
def dinfer_rt_env_info():
    raise RuntimeError("env info broken")
