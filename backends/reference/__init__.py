"""The ``reference`` backend: the validation oracle (every IR op's reference semantics)."""

from dinfer_rt.backends.reference.backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
