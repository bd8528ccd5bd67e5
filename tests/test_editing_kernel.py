"""The editing rule's device step (issue #39 point 2): greedy joint_threshold (``penalty_lambda``
0) decides from the confidence head's (argmax, probability) per block slot, so a backend's edit
kernel writes mask-to-token commits and token-to-token edits into the sequence in place and the
block end stays on the device (no host sync per step).

- the reference's torch ``commit_edit`` (the semantics) equals ``strategies`` joint_threshold on
  random logits;
- the shared Triton ``commit_edit_kernel`` (cuda, rocm_dcu; persistent over Ascend's vector
  cores) equals the reference under the interpreter, with exact ties at the thresholds and
  between the best masked slots (probabilities on a 1/8 grid, thresholds on it too);
- ascend picks the Triton kernel where Triton runs, else the torch step (simulated torch_npu);
- end to end: a cuda-interpreted greedy joint_threshold decode takes the device path (the kernel
  runs, ``decode.py`` reads nothing on the host inside a step nor between syncs) and equals the
  cpu decode token for token, with the same edits, post steps and forwards.
"""

from __future__ import annotations

import sys

import pytest
import torch

import dinfer_rt
from dinfer_rt import plugins, strategies
from dinfer_rt.backend import Availability
from dinfer_rt.backends.reference.backend import commit_edit
from dinfer_rt.ir import ops

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter padding lanes

MASK = 3


def _inputs(seed: int, b: int, slots: int, vocab: int = 5):
    """Random block state: probabilities on a 1/8 grid (exact ties with the thresholds and
    between slots), tokens from a small vocabulary (the argmax often equals the current token),
    masked slots, and editable ones among the unmasked (the caller's rule: disjoint)."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.randint(0, 9, (b, slots), generator=g).float() / 8
    token = torch.randint(0, vocab, (b, slots), generator=g)
    token[token == MASK] = MASK + 1
    masked = torch.rand(b, slots, generator=g) < 0.4
    masked[-1] = False  # a row without a mask: edits only
    current = torch.randint(0, vocab, (b, slots), generator=g)
    current[current == MASK] = MASK + 1
    current[masked] = MASK
    editable = ~masked & (torch.rand(b, slots, generator=g) < 0.7)
    return conf, token, masked, editable, current


def _by_hand(conf, token, masked, editable, current, tau, edit_tau):
    """The rule slot by slot in Python."""
    commit, edit = torch.zeros_like(masked), torch.zeros_like(masked)
    for r in range(conf.shape[0]):
        m = [i for i in range(conf.shape[1]) if masked[r, i]]
        above = [i for i in m if conf[r, i] > tau]
        for i in above or ([max(m, key=lambda i: (float(conf[r, i]), -i))] if m else []):
            commit[r, i] = True
        for i in range(conf.shape[1]):
            edit[r, i] = bool(editable[r, i]) and int(token[r, i]) != int(current[r, i]) and conf[r, i] > edit_tau
    return commit, edit


@pytest.mark.parametrize("seed", range(12))
def test_reference_step_is_the_rule(seed):
    """The torch ``commit_edit`` on the head's outputs equals strategies' joint_threshold on the
    logits (mask token banned), and a slot-by-slot transcription on a grid with exact ties."""
    g = torch.Generator().manual_seed(seed)
    b, slots, vocab = 4, 9, 11
    logits = torch.randn(b, slots, vocab, generator=g) * 3
    _, token, masked, editable, current = _inputs(seed, b, slots, vocab)
    for tau, edit_tau in ((0.5, 0.0), (0.3, 0.25), (0.9, 0.6)):
        z = logits.clone()
        z[..., MASK] = float("-inf")
        step = strategies.StepInput(z, masked, torch.ones(b, dtype=torch.long), 0.0, None, current=current,
                                    editable=editable)  # fmt: skip
        x0, write = strategies.make_joint_threshold(tau, edit_tau, 0.0)(step)
        conf, tok = ops.confidence(logits, banned=MASK)
        x = torch.full((b, slots + 2), -7)
        x[:, 1:-1] = current
        commit, edit = commit_edit(conf, tok, masked, editable, x[:, 1:-1], threshold=tau, edit_threshold=edit_tau)
        assert torch.equal(commit, write & masked) and torch.equal(edit, write & editable)
        assert torch.equal(x[:, 1:-1], torch.where(commit | edit, x0, current))
        assert (x[:, 0] == -7).all() and (x[:, -1] == -7).all()
    conf, token, masked, editable, current = _inputs(seed, 6, 13)
    for tau, edit_tau in ((0.5, 0.0), (0.25, 0.75), (1.0, 0.5)):
        x = current.clone()
        got = commit_edit(conf, token, masked, editable, x, threshold=tau, edit_threshold=edit_tau)
        want = _by_hand(conf, token, masked, editable, current, tau, edit_tau)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(x, torch.where(want[0] | want[1], token, current))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_triton_kernel_equals_the_reference(monkeypatch, seed, persistent):
    """The shared kernel under the interpreter: one program per row (GPUs) or persistent over 3
    'cores' (Ascend's launch), odd block lengths; writes only the block's slots."""
    from dinfer_rt.backends.ascend.launch import commit_launch
    from dinfer_rt.backends.triton.ops import commit_edit as kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    slots = (5, 8, 13)[seed % 3]
    b = 7 if persistent else 4
    conf, token, masked, editable, current = _inputs(100 + seed, b, slots)
    launch = commit_launch(vector_cores=3) if persistent else {}
    for tau, edit_tau in ((0.5, 0.0), (0.25, 0.75), (1.0, 0.5)):
        want_x = current.clone()
        want = commit_edit(conf, token, masked, editable, want_x, threshold=tau, edit_threshold=edit_tau)
        seq = torch.full((b, slots + 5), -1)
        seq[:, 2 : 2 + slots] = current
        got = kernel(conf, token, masked, editable, seq[:, 2 : 2 + slots], threshold=tau, edit_threshold=edit_tau,
                     **launch)  # fmt: skip
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (tau, edit_tau)
        assert torch.equal(seq[:, 2 : 2 + slots], want_x)
        assert (seq[:, :2] == -1).all() and (seq[:, 2 + slots :] == -1).all()


def _ascend(monkeypatch, interpret: bool):
    from dinfer_rt.backends.ascend.plugin import AscendBackend
    from dinfer_rt.testing import simulated_torch_npu

    simulated_torch_npu.install(monkeypatch)
    monkeypatch.setattr(AscendBackend, "is_available", lambda self: Availability(True, "simulated torch_npu"))
    monkeypatch.setattr(AscendBackend, "device_type", "cpu")
    if interpret:
        monkeypatch.setenv("DINFER_INTERPRET", "1")
    else:
        monkeypatch.delenv("DINFER_INTERPRET", raising=False)
    plugins.registry.cache_clear()
    return plugins.select_backend("ascend")


@pytest.mark.parametrize("interpret", [True, False])
def test_ascend_edit_kernel(monkeypatch, ckpt_dir, interpret):
    """Ascend (simulated torch_npu): the shared Triton kernel persistent over its vector cores
    where Triton runs it, else the torch step; either equals the reference, and the decode state
    on an ascend model takes it and passes ``validate``'s editing probes."""
    from dinfer_rt.backends.ascend import ops as ascend_ops
    from dinfer_rt.decode import Cohort
    from dinfer_rt.validation import editing

    monkeypatch.setattr(ascend_ops, "triton_usable", lambda interp: interp)  # no triton-ascend here
    kernel = _ascend(monkeypatch, interpret).edit_kernel()
    model = dinfer_rt.load_model(ckpt_dir("llada2"), backend="ascend", dtype="float32")
    params = dinfer_rt.SamplingParams(strategy="joint_threshold", gen_length=8, block_length=4)
    assert Cohort(model, [[7, 8, 9]], params).device_rule == "joint"
    assert editing.probes(model)["passed"]
    if interpret:
        assert kernel.keywords["programs"] >= 1 and kernel.keywords["min_block"] == 32
    else:
        assert kernel is commit_edit
    conf, token, masked, editable, current = _inputs(7, 5, 11)
    want_x, x = current.clone(), current.clone()
    want = commit_edit(conf, token, masked, editable, want_x, threshold=0.5, edit_threshold=0.25)
    got = kernel(conf, token, masked, editable, x, threshold=0.5, edit_threshold=0.25)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(x, want_x)


def test_edit_kernels_by_backend(monkeypatch):
    """cuda / rocm_dcu: the Triton step; cpu and the reference oracle: none (the torch rule on
    the logits decides, on the host)."""
    from dinfer_rt.backends.triton.ops import commit_edit as kernel

    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()

    def edit_kernel(name):
        return getattr(plugins.select_backend(name), "edit_kernel", lambda: None)()

    assert edit_kernel("cuda") is kernel and edit_kernel("rocm_dcu") is kernel
    assert edit_kernel("cpu") is None and edit_kernel("reference") is None


_SYNCS = ("__bool__", "__int__", "__float__", "item", "tolist", "cpu", "numpy")


@pytest.mark.parametrize("name, gen", [("llada", 16), ("llada2", 8)])
def test_cuda_decode_decides_edits_on_the_device(monkeypatch, ckpt_dir, name, gen):
    """A greedy joint_threshold decode on the cuda backend (interpreter) runs the edit kernel,
    reads nothing on the host inside a step nor in ``prepare`` between the syncs of
    ``sync_every``, and equals the cpu decode (the torch rule on logits) token for token, with
    the same edits, post steps and forwards; a padded batch of different prompt lengths (llada2:
    block-causal, the first block holds prompt slots, never edited)."""
    from dinfer_rt import decode
    from dinfer_rt.backends.triton import ops as cuda_ops
    from dinfer_rt.decode import Cohort

    DECODE = decode.__file__

    path = ckpt_dir(name)
    prompts = [[7, 8, 9, 10, 11, 12, 13], [9, 8, 7]]
    params = dinfer_rt.SamplingParams(
        strategy="joint_threshold", threshold=0.6, edit_threshold=0.1, max_post_steps=3, batch_size=2,
        block_length=8, gen_length=gen,
    )  # fmt: skip
    want = dinfer_rt.LLM(path, backend="cpu", sync_every=3).generate(prompts, params)

    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    calls, reads, steps = [], [], []
    real = cuda_ops.commit_edit
    monkeypatch.setattr(cuda_ops, "commit_edit", lambda *a, **k: calls.append(1) or real(*a, **k))
    decide = Cohort.decide
    monkeypatch.setattr(Cohort, "decide", lambda self, out: steps.append(self.step) or decide(self, out))

    def spy(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            f = sys._getframe(1)
            if f.f_code.co_filename == DECODE and isinstance(cohort := f.f_locals.get("self"), Cohort):
                reads.append((f.f_code.co_name, getattr(cohort, "step", 0), cohort.sync_every))
            return orig(self, *a, **k)

        return read

    llm = dinfer_rt.LLM(path, backend="cuda", sync_every=3)
    with pytest.MonkeyPatch.context() as spies:
        for name in _SYNCS:
            spies.setattr(torch.Tensor, name, spy(name))
        got = llm.generate(prompts, params)
    assert len(calls) == len(steps), "a step decided without the edit kernel"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.stats.edits, o.stats.post_steps, o.stats.nfe) for o in got] == [
        (o.stats.edits, o.stats.post_steps, o.stats.nfe) for o in want
    ]
    assert sum(o.stats.edits for o in want) > 0  # the decode edits, so edits went through the kernel
    # inside a step: only the step that ends at a sync reads its counters (edits, post steps)
    in_step = [
        r
        for r in reads
        if r[0] in ("decide", "_decide_editing", "_head", "forward", "_forward")
        and not (r[0] == "_decide_editing" and (r[1] + 1) % r[2] == 0)
    ]
    between = [r for r in reads if r[0] == "prepare" and r[1] % r[2]]
    assert not in_step and not between, (in_step[:5], between[:5])
    assert any(r[0] == "prepare" for r in reads)  # the spies see decode.py's reads (at the syncs)
    assert any(s % 3 for s in steps)  # steps between the syncs happened


@pytest.fixture
def cuda_llada2(monkeypatch, ckpt_dir):
    monkeypatch.setenv("DINFER_INTERPRET", "1")
    plugins.registry.cache_clear()
    path = ckpt_dir("llada2")
    return dinfer_rt.load_model(path, backend="cuda"), dinfer_rt.load_model(path, backend="reference", dtype="float64")


def test_validate_checks_the_edit_kernel(cuda_llada2, monkeypatch):
    """``validate``'s editing check on the cuda backend (interpreter) goes through the edit
    kernel (its probes feed logits to the decode state, which takes the head's argmax and
    probability to the kernel) and passes; the kernel with ``>=`` for ``>`` fails the probes."""
    from dinfer_rt.backends.triton import ops as cuda_ops
    from dinfer_rt.validation import editing, runner

    test, ref = cuda_llada2
    calls = []
    real = cuda_ops.commit_edit
    monkeypatch.setattr(cuda_ops, "commit_edit", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = editing.check(test, ref, [[7, 8, 9, 10, 11, 12]], runner.EDIT_SMALL, 1e-3)
    assert res["passed"], res
    assert calls and res["decisions"]["steps"] > 2

    def greater_or_equal(*a, threshold, edit_threshold, **k):  # the planted fault
        return real(*a, threshold=threshold - 1e-6, edit_threshold=edit_threshold - 1e-6, **k)

    monkeypatch.setattr(cuda_ops, "commit_edit", greater_or_equal)
    assert not editing.probes(test)["passed"]
