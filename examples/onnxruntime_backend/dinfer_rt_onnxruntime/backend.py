"""The ONNX Runtime backend object: export once per graph, run with an InferenceSession."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dinfer_rt.backend import Availability, Backend, Capabilities
from dinfer_rt.errors import BackendError
from dinfer_rt.ir import Graph
from dinfer_rt_onnxruntime.export import OUTPUT_SUFFIX, export


class OrtExecutable:
    """Callable like dinfer-rt's Executable: ``exe(inputs) -> {output: tensor}``."""

    def __init__(self, graph: Graph, weights: Mapping[str, torch.Tensor], provider: str) -> None:
        import onnxruntime as ort

        self.graph = graph
        self.fallbacks: dict[str, int] = {}
        model = export(graph, weights)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=[provider])
        except Exception as e:  # ORT raises its own exception types
            raise BackendError(
                f"onnxruntime could not build a session for graph {graph.name} on {provider}: {e}"
            ) from e
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        feed = {n: inputs[n].detach().cpu().numpy() for n in self.input_names}
        outs = self.session.run(self.output_names, feed)
        result = {}
        for name, arr in zip(self.output_names, outs):
            t = torch.from_numpy(np.ascontiguousarray(arr))
            if name.endswith(OUTPUT_SUFFIX):  # a new KV cache: keep the attention op's in-place contract
                name = name.removesuffix(OUTPUT_SUFFIX)
                inputs[name].copy_(t)
                t = inputs[name]
            result[name] = t
        return result


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    flavour = "CPUExecutionProvider"
    device_type = "cpu"
    priority = -10  # never auto-selected over the native backends

    def is_available(self) -> Availability:
        try:
            import onnx  # noqa: F401
            import onnxruntime as ort
        except ImportError as e:
            return Availability(False, f"cannot import {e.name}: pip install onnx onnxruntime")
        providers = ort.get_available_providers()
        if self.flavour not in providers:
            return Availability(False, f"execution provider {self.flavour} not in this build ({', '.join(providers)})")
        return Availability(True, f"onnxruntime {ort.__version__}, providers {', '.join(providers)}")

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=(torch.float32,))

    def compile(self, graph: Graph, weights: Mapping[str, torch.Tensor]) -> OrtExecutable:
        return OrtExecutable(graph, weights, self.flavour)

    def versions(self) -> dict[str, str]:
        try:
            import onnxruntime

            return {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__}
        except ImportError:
            return {"torch": torch.__version__, "onnxruntime": "not installed"}
