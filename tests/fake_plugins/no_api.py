"""A plugin module that does not say which hook API it was written for."""

from dinfer_rt.plugins import hookimpl


@hookimpl
def dinfer_rt_env_info():
    return {"never": "seen"}
