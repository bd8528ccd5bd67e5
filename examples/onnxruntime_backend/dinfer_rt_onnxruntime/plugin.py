"""Entry point (group ``dinfer_rt.backends``): registers the backend through dinfer-rt's hooks."""

from dinfer_rt.plugins import hookimpl
from dinfer_rt_onnxruntime.backend import OnnxRuntimeBackend

DINFER_RT_HOOK_API = 2  # the dinfer-rt hook API this plugin was written for


@hookimpl
def dinfer_rt_register_backends():
    return [OnnxRuntimeBackend]


@hookimpl
def dinfer_rt_env_info():
    import onnx
    import onnxruntime

    return {
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxruntime providers": ",".join(onnxruntime.get_available_providers()),
    }
