"""A plugin with a misspelt hook name (pluggy accepts it and never calls it) and a good one."""

from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


@hookimpl
def dinfer_rt_register_kernel(backend_name):  # the hook is dinfer_rt_register_kernels
    return {}


@hookimpl
def dinfer_rt_env_info():
    return {"misspelt plugin": "loaded"}
