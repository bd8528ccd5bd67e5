"""dinfer-rt's operator IR: typed SSA graphs of a small set of ops.

A checkpoint is lowered into a :class:`Graph` whose ops (see :mod:`dinfer_rt.ir.ops`)
each carry shape/dtype inference and a reference semantics in torch. Backends map ops
(and fused ops) to kernels; the CPU backend runs the reference semantics directly.
"""

from dinfer_rt.ir.graph import Graph, IRError, Node, Value
from dinfer_rt.ir.ops import OPS, OpDef, op_def
from dinfer_rt.ir.types import Dim, TensorType

__all__ = ["Dim", "Graph", "IRError", "Node", "OPS", "OpDef", "TensorType", "Value", "op_def"]
