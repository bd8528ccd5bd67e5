"""ONNX Runtime backend for dinfer-rt, installed as a separate distribution."""
