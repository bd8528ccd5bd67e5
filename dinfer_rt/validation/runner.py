"""``dinfer-rt validate``: coverage, op conformance, pass checks, model-level numerics and
performance for each backend, with a verdict, a JSON report and a Markdown rendering.

Every check is a result, never an abort: a kernel that raises (or a model that does not load on
the backend) fails that check with the exception named, and the report is still complete. The
oracle is the ``reference`` backend in float64 (:data:`ORACLES`): a ``DINFER_PLUGINS`` allowlist
that excludes it is refused up front, naming it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

import dinfer_rt
from dinfer_rt import envs
from dinfer_rt.backend import Backend
from dinfer_rt.demo import task
from dinfer_rt.dtypes import resolve_dtype
from dinfer_rt.errors import BackendError
from dinfer_rt.loader import EMBEDDED_MODEL, load_model
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.plugins import availability, env_info, registry, select_backend
from dinfer_rt.sampling import SamplingParams
from dinfer_rt.validation import editing, model_checks
from dinfer_rt.validation.conformance import DTYPE_NAMES, run_conformance
from dinfer_rt.validation.perf import measure

SCHEMA_VERSION = 2  # 2: each header backend has "emulation"; "performance" may be {"skipped": why}

# the editing rule's lock-step check: LLaDA2.1's quality preset, a short post-step budget
EDIT_PARAMS = SamplingParams(
    strategy="joint_threshold", threshold=0.7, edit_threshold=0.5, max_post_steps=4, gen_length=16, block_length=8,
    early_stop=False,
)  # fmt: skip
EDIT_SMALL = SamplingParams(
    strategy="joint_threshold", threshold=0.5, edit_threshold=0.2, max_post_steps=2, gen_length=8, block_length=4,
    early_stop=False,
)  # fmt: skip
SEED = 0
ORACLES = ("reference",)  # the backends validate measures against (float64 reference semantics)


def require_oracles(command: str = "validate") -> None:
    """Refuse, naming them, when the oracle backends are not registered (a ``DINFER_PLUGINS``
    allowlist that leaves them out): otherwise the first model check fails on 'unknown backend'."""
    backends = registry().backends
    missing = [name for name in ORACLES if name not in backends]
    if not missing:
        return
    names = ", ".join(repr(n) for n in missing)
    allow = os.environ.get(envs.DINFER_PLUGINS)
    if allow is not None and allow.strip():
        kept = ",".join([p.strip() for p in allow.split(",") if p.strip()] + missing)
        raise BackendError(
            f"{command} needs its oracle backend(s) {names} (float64 reference semantics), which "
            f"{envs.DINFER_PLUGINS}={envs.shown(allow)} excludes; add them: {envs.DINFER_PLUGINS}={envs.shown(kept)}"
        )
    raise BackendError(
        f"{command} needs its oracle backend(s) {names}, which are not registered (is dinfer-rt installed?)"
    )


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def guarded(check, *args, **kwargs) -> dict:
    """``check(*args, **kwargs)``, or a failed result naming the exception it raised."""
    try:
        return check(*args, **kwargs)
    except Exception as e:  # a crashing kernel is a failed check, not a lost report
        return {"passed": False, "error": _error(e)}


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(backends: list[Backend], env: dict[str, str]) -> dict:
    """What ran where; ``env``: the DINFER_* variables as the user set them (taken before the
    backends were selected: selecting one writes ``DINFER_BACKEND`` back for child processes)."""
    return {
        "dinfer_rt": dinfer_rt.__version__,
        "commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "backends": [
            {
                "name": b.name,
                "flavour": b.flavour,
                "arch": b.arch,
                "device": b.device_type,
                "emulation": b.emulation(),
                "versions": b.versions(),
            }
            for b in backends
        ],
        "plugins": env_info(),  # the facts plugins report (dinfer_rt_env_info)
        "loaded_plugins": sorted(set(registry().plugin_of.values())),
        # every plugin fault recorded so far (discovery, and the selections above)
        "plugin_failures": [f"{f.name} ({f.hook or 'not loaded'}): {f.reason}" for f in registry().failures],
        "env": env,
        "seed": SEED,
        "command": " ".join(["dinfer-rt", *sys.argv[1:]]) if sys.argv else "",
    }


def tiny_checkpoints(root: Path, quick: bool) -> dict[str, Path]:
    from dinfer_rt.testing import checkpoints

    names = ["llada2"] if quick else ["llada", "dream", "llada_moe", "llada2"]
    return {n: getattr(checkpoints, n)(root / n) for n in names}


def coverage(backend: Backend) -> dict:
    from dinfer_rt.lowering import lower

    try:
        table = backend.kernel_table()
    except Exception as e:  # a malformed kernel table (unknown op, not callable): named, and every check fails on it
        return {"ops": {}, "native_node_fraction": 0.0, "error": _error(e)}
    graph = lower(parse_spec(EMBEDDED_MODEL), torch.float32)
    nodes = [table.get(n.op, (None, "missing"))[1] for n in graph.nodes]
    native = sum(1 for s in nodes if not s.startswith(("fallback", "missing")))
    return {"ops": {op: src for op, (_, src) in sorted(table.items())}, "native_node_fraction": native / len(nodes)}


def pass_checks(backend: Backend, ckpts: dict[str, Path], dtype: torch.dtype) -> dict:
    """Fused versus unfused logits on this backend, for the passes active on it."""
    rows, ok = [], True
    for name, path in ckpts.items():
        ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(SEED))
        try:
            fused = load_model(path, backend=backend.name, dtype=dtype, tokenizer=False)
            disabled = [p.name for p in backend.passes()]
            plain = load_model(path, backend=backend.name, dtype=dtype, tokenizer=False, disable_passes=disabled)
            a, b = fused.forward(ids, block_size=4).double().cpu(), plain.forward(ids, block_size=4).double().cpu()
            rel = ((a - b).abs().max() / b.abs().max()).item()
        except Exception as e:
            ok = False
            rows.append({"model": name, "rewrites": {}, "max_rel": float("inf"), "passed": False, "error": _error(e)})
            continue
        passed = rel <= model_checks.MODEL_TOLERANCE[dtype]
        ok &= passed
        rows.append({"model": name, "rewrites": fused.pass_counts, "max_rel": rel, "passed": passed})
    return {"passed": ok, "rows": rows}


def family_checks(backend: Backend, path: Path, dtype: torch.dtype) -> dict:
    """Model-level checks of one tiny checkpoint (a model family) on ``backend`` against the
    float64 reference: teacher-forced logits, free running and the editing rule's decisions, on
    a mixed-length batch (one row left-padded). Each value has ``passed``."""
    try:
        t = load_model(path, backend=backend.name, dtype=dtype)
        r = load_model(path, backend="reference", dtype="float64")
    except Exception as e:
        return {"load": {"passed": False, "error": _error(e)}}
    prompts = [[7, 8, 9, 10], [11, 12]]
    small = SamplingParams(gen_length=8, block_length=4, strategy="threshold", threshold=0.5, early_stop=False)
    return {
        "teacher_forced": guarded(model_checks.teacher_forced, t, r, prompts, None, 8),
        "free_running": guarded(model_checks.free_running, t, r, prompts, small),
        f"decisions ({editing.RULE})": guarded(
            editing.check,
            t,
            r,
            [prompts[0]] if t.spec.block_causal else prompts,
            EDIT_SMALL,
            model_checks.NEAR_TIE[t.dtype],
        ),
    }


def compile_notes(backend: Backend) -> list[str]:
    """What the report must say of a backend that compiles whole graphs itself (``compile``
    overridden, as a whole-graph runtime plugin does): op conformance and coverage read its
    ``kernel_table()``, which its compiled graphs need not run; the model checks run ``compile``."""
    if type(backend).compile is Backend.compile:
        return []
    return [
        f"{backend.name} overrides compile(): op conformance and coverage checked its kernel_table() "
        "(the kernels a per-op executable would run), not the graphs compile() builds; the fused-vs-unfused "
        "and model checks below run compile() and are what cover it"
    ]


def dtype_coverage(backend: Backend, dtypes: list[torch.dtype]) -> dict[str, list[str]]:
    """Which requested dtypes op conformance checks, which it skips (the backend does not claim
    them) and which the backend claims that nobody asked for: a claim is only as good as a run
    that checked it, so the report says which claims went unchecked (``--dtypes`` adds them)."""
    claimed = list(backend.capabilities().dtypes)
    return {
        "checked": [DTYPE_NAMES[d] for d in dtypes if d in claimed],
        "not_claimed": [DTYPE_NAMES[d] for d in dtypes if d not in claimed],
        "claimed_unchecked": [DTYPE_NAMES[d] for d in claimed if d not in dtypes and d in DTYPE_NAMES],
    }


def validate_backend(backend: Backend, dtypes: list[torch.dtype], quick: bool, bar) -> dict:
    """Every section for ``backend``, each check guarded. A plugin fault met while its
    contributions were gathered fails it too: the backend did not run what its porter wrote."""
    out: dict = {"backend": backend.describe(), "coverage": coverage(backend)}
    faults = [f"plugin {f.name} failed in {f.hook}: {f.reason}" for f in backend.contributions.faults]
    if "error" in out["coverage"]:  # a malformed kernel table: every check would fail on it, say it once
        bar.update(5)
        failed = [*faults, f"kernel table: {out['coverage']['error']}"]
        skipped = {"skipped": "not measured: the kernel table is malformed"}
        out |= {"conformance": [], "passes": {"passed": False, "rows": []}, "models": {}, "precision": {"rows": []}}
        return out | {"performance": skipped, "unexpected_passes": [], "failures": failed, "verdict": "fail"}
    emulated = backend.emulation()  # an interpreter or a simulation: no timings, fewer accuracy items
    out["dtypes"] = dtype_coverage(backend, dtypes)
    out["notes"] = compile_notes(backend)
    out["conformance"] = run_conformance(backend, dtypes, quick, progress=lambda: bar.update(0))
    bar.update(1)
    dtype = torch.float32 if torch.float32 in backend.capabilities().dtypes else backend.capabilities().dtypes[0]
    models: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = tiny_checkpoints(Path(tmp), quick)
        out["passes"] = pass_checks(backend, ckpts, dtype)
        bar.update(1)
        try:
            test = load_model(EMBEDDED_MODEL, backend=backend.name, dtype=dtype)
            ref = load_model(EMBEDDED_MODEL, backend="reference", dtype="float64")
        except Exception as e:  # the backend cannot even build the model: every embedded check fails on it
            test = ref = None
            models["embedded"] = {"load": {"passed": False, "error": _error(e)}}
            out["precision"] = {"rows": [], "error": _error(e)}
        if test is not None:
            _embedded_checks(test, ref, quick, emulated, models, out)
        bar.update(2)
        for name, path in ckpts.items():
            models[name] = family_checks(backend, path, dtype)
        out["models"] = models
        if emulated is not None:  # the stand-in's speed says nothing about the device (and cost minutes of CI)
            out["performance"] = {"skipped": f"not measured: the kernels ran on {emulated}"}
        elif test is None:
            out["performance"] = {"skipped": "not measured: the model did not load on this backend"}
        else:
            items = task.heldout(8 if quick else 32)
            params = SamplingParams(strategy="threshold", threshold=0.9, early_stop=False, batch_size=len(items))
            try:
                out["performance"] = measure(
                    test, _chat_prompts(test, items), params, warmup=1, iters=2 if quick else 5
                )
            except Exception as e:
                out["performance"] = {"error": _error(e)}
        bar.update(1)
    failed = [
        f"op {r['op']}/{r['bucket']}/{r['dtype']}: {r['status']}" + (f" ({r['detail']})" if r["detail"] else "")
        for r in out["conformance"]
        if r["status"] in ("fail", "error")
    ]
    failed += faults
    if not out["passes"]["passed"]:
        errors = [f"{r['model']}: {r['error']}" for r in out["passes"]["rows"] if "error" in r]
        failed.append("fused vs unfused" + (f" ({'; '.join(errors)})" if errors else ""))
    for name, checks in models.items():
        failed += [
            f"{name}: {check}" + (f" raised {res['error']}" if "error" in res else "")
            for check, res in checks.items()
            if not res["passed"]
        ]
    for section in ("precision", "performance"):
        if "error" in out[section]:
            failed.append(f"{section}: raised {out[section]['error']}")
    out["unexpected_passes"] = [
        f"{r['op']}/{r['bucket']}/{r['dtype']}" for r in out["conformance"] if r["status"] == "unexpected-pass"
    ]
    out["failures"] = failed
    out["verdict"] = "pass" if not failed else "fail"
    return out


def _chat_prompts(model, items) -> list[list[int]]:
    tok = model.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": it.letters}])) for it in items]


def _embedded_checks(test, ref, quick: bool, emulated: str | None, models: dict, out: dict) -> None:
    """The embedded model's checks, each guarded (a raising kernel fails that check only)."""
    items = task.heldout(8 if quick else 32)
    tok = test.tokenizer
    llm_prompts = _chat_prompts(test, items)
    # mixed lengths (left-padded batches): drop 0-3 leading letters per row for the logit checks
    mixed = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": it.letters[i % 4 :]}]))
        for i, it in enumerate(items)
    ]
    answers = [tok.encode(it.answer()) for it in items]
    answers = [a + [test.pad_id] * (40 - len(a)) for a in answers]
    params = SamplingParams(strategy="threshold", threshold=0.9, early_stop=False, batch_size=len(items))
    near_tie = model_checks.NEAR_TIE[test.dtype]
    models["embedded"] = {
        "teacher_forced": guarded(model_checks.teacher_forced, test, ref, mixed, answers, 40),
        "decisions": guarded(model_checks.decisions, test, ref, mixed, 40),
        # the editing rule's per-step decisions (its block state machine included) vs its oracle
        f"decisions ({editing.RULE})": guarded(editing.check, test, ref, mixed[:3], EDIT_PARAMS, near_tie),
        "free_running": guarded(model_checks.free_running, test, ref, llm_prompts, params),
    }
    # informational (no verdict): how far each quantised weight format is from this backend's full precision
    fractions = (0.5,) if quick else (1.0, 0.5, 0.1)  # interpreted backends run these slowly
    try:
        out["precision"] = model_checks.precision_report(test, mixed[:4], answers[:4], 40, fractions)
    except Exception as e:
        out["precision"] = {"rows": [], "error": _error(e)}
    from dinfer_rt.llm import LLM

    # quick on emulated kernels (CI's interpreter runs): half the items, each a minute's work there
    n = 200 if not quick else 24 if emulated else 50
    models["embedded"]["accuracy"] = guarded(lambda: model_checks.task_accuracy(LLM(test), LLM(ref), n))


def resolve_backends(spec: str) -> list[Backend]:
    if spec == "all":  # selected like a named one: probed, identified, plugin contributions gathered
        return [select_backend(name) for name, cls in sorted(registry().backends.items()) if availability(cls)]
    return [select_backend(name.strip()) for name in spec.split(",") if name.strip()]


def validate(spec: str, quick: bool = False, dtypes: str = "float32,bfloat16") -> dict:
    env = envs.snapshot()
    require_oracles()
    backends = resolve_backends(spec)
    dts = [resolve_dtype(d.strip()) for d in dtypes.split(",") if d.strip()]
    report = {
        "schema_version": SCHEMA_VERSION,
        "quick": quick,
        "dtypes": [DTYPE_NAMES[d] for d in dts],
        "header": header(backends, env),
        "results": [],
    }
    with tqdm(total=5 * len(backends), desc="validate", unit="section") as bar:
        for b in backends:
            bar.set_postfix_str(b.name)
            report["results"].append(validate_backend(b, dts, quick, bar))
    report["verdict"] = "pass" if all(r["verdict"] == "pass" for r in report["results"]) else "fail"
    return report
