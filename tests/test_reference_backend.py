"""The ``reference`` backend (#37): the validation oracle as a backend of its own, registered
like any plugin, running every op's reference semantics unfused with no native code; ``cpu``
(the fast path) agrees with it."""

from __future__ import annotations

import torch

import dinfer_rt
from dinfer_rt import plugins
from dinfer_rt.demo import task
from dinfer_rt.ir import OPS
from dinfer_rt.llm import LLM
from dinfer_rt.loader import EMBEDDED_MODEL


def test_reference_backend_runs_only_the_op_references_unfused(monkeypatch):
    monkeypatch.delenv("DINFER_BACKEND", raising=False)
    assert plugins.select_backend(None).name != "reference"  # never the automatic choice
    backend = plugins.select_backend("reference")
    table = backend.kernel_table()
    assert {src for _, src in table.values()} == {"fallback:reference"}
    assert all(table[name][0] is op.reference for name, op in OPS.items())
    assert backend.commit_kernel() is None  # decisions on the host, by the shared rules
    model = dinfer_rt.load_model(EMBEDDED_MODEL, backend="reference", dtype="float64")
    ops = {node.op for node in model.graph(cached=True).nodes}
    assert not ops & {"attention_block", "mlp_block", "add_rms_norm", "rope_attention", "swiglu"}  # nothing fused
    assert set(model.pass_counts) == {"cse", "dce", "dce_after_fusion", "reorder_memory"}  # no fusion pass ran


def test_cpu_agrees_with_the_reference_backend():
    """float32 ``cpu`` (native kernels, fused) against float64 ``reference``: logits within 1e-4
    relative, and greedy decoding of held-out prompts the same."""
    ref = LLM(dinfer_rt.load_model(EMBEDDED_MODEL, backend="reference", dtype="float64"))
    fast = LLM(dinfer_rt.load_model(EMBEDDED_MODEL, backend="cpu", dtype="float32"))
    prompts = [fast.encode(it.letters, True) for it in task.heldout(4)]
    ids = torch.tensor([prompts[0] + [fast.model.mask_id] * 40])
    want, got = ref.model.forward(ids), fast.model.forward(ids).double()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    assert [o.token_ids for o in fast.generate(prompts)] == [o.token_ids for o in ref.generate(prompts)]
