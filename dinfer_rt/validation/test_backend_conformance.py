"""Op conformance and model-level checks of ``--dinfer-backend`` as pytest tests."""

from __future__ import annotations

import pytest
import torch

from dinfer_rt.plugins import select_backend
from dinfer_rt.validation.conformance import load_json, run_case


@pytest.fixture(scope="session")
def backend(request):
    from dinfer_rt.validation.runner import require_oracles

    require_oracles("pytest --pyargs dinfer_rt.validation")
    return select_backend(request.config.getoption("--dinfer-backend"))


def test_op_conformance(backend, op_case):
    case, dtype = op_case
    if dtype not in backend.capabilities().dtypes:
        pytest.skip(f"{backend.name} does not support {dtype}")
    r = run_case(case, backend, dtype, load_json("tolerances.json"), load_json("known_failures.json")["backends"])
    if r.status == "xfail":
        pytest.xfail(r.detail)
    assert r.status == "pass", (
        f"{r.op}/{r.bucket}/{r.dtype}: {r.status}, max rel {r.max_rel:.3g} > {r.tolerance}; {r.detail}"
    )


def test_embedded_model_free_running_matches_reference(backend):
    import dinfer_rt
    from dinfer_rt.demo import task
    from dinfer_rt.validation import model_checks

    dtype = torch.float32 if torch.float32 in backend.capabilities().dtypes else backend.capabilities().dtypes[0]
    test = dinfer_rt.load_model(backend=backend.name, dtype=dtype)
    ref = dinfer_rt.load_model(backend="reference", dtype="float64")
    tok = test.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": it.letters}])) for it in task.heldout(8)]
    params = dinfer_rt.SamplingParams(strategy="threshold", threshold=0.9, early_stop=False)
    res = model_checks.free_running(test, ref, prompts, params)
    assert res["passed"], res
