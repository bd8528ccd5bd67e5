"""Render a validation report (the JSON object) as Markdown for a PR or a bug report."""

from __future__ import annotations


def _f(v: float) -> str:
    return f"{v:.2e}" if isinstance(v, float) else str(v)


def dtype_line(dts: dict[str, list[str]]) -> str:
    """What op conformance checked, skipped and left unchecked (``runner.dtype_coverage``)."""
    line = f"dtypes checked: {', '.join(dts['checked']) or 'none'}"
    if dts["not_claimed"]:
        line += f"; requested, not claimed by the backend (skipped): {', '.join(dts['not_claimed'])}"
    if dts["claimed_unchecked"]:
        line += f"; claimed, not checked (add them to --dtypes): {', '.join(dts['claimed_unchecked'])}"
    return line


def render(report: dict) -> str:
    h = report["header"]
    out = [
        f"# dinfer-rt validation: **{report['verdict'].upper()}**",
        "",
        f"- dinfer-rt {h['dinfer_rt']} (commit {h['commit']}), torch {h['torch']}, Python {h['python']}",
        f"- platform: {h['platform']}",
        f"- command: `{h['command']}`",
        f"- seed: {h['seed']}; quick: {report['quick']}; dtypes: {', '.join(report['dtypes'])}",
        f"- DINFER_* env: {h['env'] or 'none'}",
        f"- plugins loaded: {', '.join(h.get('loaded_plugins', [])) or 'none'}; "
        f"their environment facts: {h['plugins'] or 'none'}",
        *[f"- plugin failure: {f}" for f in h.get("plugin_failures", [])],
        "",
    ]
    for b in h["backends"]:
        emulated = f" (emulated: {b['emulation']})" if b.get("emulation") else ""
        out.append(
            f"- backend `{b['name']}` flavour {b['flavour']} arch {b['arch']} device {b['device']}{emulated}: "
            f"{b['versions']}"
        )
    for r in report["results"]:
        out += ["", f"## {r['backend']}: {r['verdict']}", ""]
        if r["failures"]:
            out += ["Failures:", *[f"- {f}" for f in r["failures"]], ""]
        if r["unexpected_passes"]:
            out += [
                "Unexpected passes (remove from known_failures.json):",
                *[f"- {u}" for u in r["unexpected_passes"]],
                "",
            ]
        out += [*[f"Note: {n}" for n in r.get("notes", [])], *([""] if r.get("notes") else [])]
        cov = r["coverage"]
        out += [f"### Coverage: {cov['native_node_fraction']:.0%} of the embedded model's nodes on native kernels", ""]
        if "error" in cov:
            out += [f"Kernel table: {cov['error']}", ""]
        out += ["### Op conformance (vs float64 reference)", ""]
        if dts := r.get("dtypes"):
            out += [dtype_line(dts), ""]
        out += [
            "| op | bucket | dtype | status | max rel err | tolerance | kernel | detail |",
            "|---|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {c['op']} | {c['bucket']} | {c['dtype']} | {c['status']} | {_f(c['max_rel'])} | "
            f"{c['tolerance']['rel']:.0e} | {c['kernel']} | {c['detail'] if c['status'] != 'pass' else ''} |"
            for c in r["conformance"]
        ]
        out += ["", "### Fused vs unfused", "", "| model | rewrites | max rel err | passed |", "|---|---|---|---|"]
        out += [
            f"| {p['model']} | {p['rewrites']} | {_f(p['max_rel'])} | "
            + (f"False: {p['error']} |" if "error" in p else f"{p['passed']} |")
            for p in r["passes"]["rows"]
        ]
        if r.get("precision", {}).get("error"):
            out += ["", f"### Quantised weights: not reported ({r['precision']['error']})"]
        if r.get("precision", {}).get("rows"):
            out += [
                "",
                "### Quantised weights vs this backend's full precision (embedded model, informational)",
                "",
                "| precision | mask fraction | max rel logit err | argmax agreement | threshold decisions agree |",
                "|---|---|---|---|---|",
            ]
            out += [
                f"| {row['precision']} | {row['mask_fraction']} | {_f(row['max_rel'])} | "
                f"{row['argmax_agreement']:.3f} | {row['decision_agreement']:.3f} |"
                for row in r["precision"]["rows"]
            ]
        out += ["", "### Model level (vs float64 reference)", ""]
        for name, all_checks in r["models"].items():
            errors = {check: res for check, res in all_checks.items() if "error" in res}
            checks = {check: res for check, res in all_checks.items() if check not in errors}
            line = f"**{name}**:"
            if "teacher_forced" in checks:
                tf = checks["teacher_forced"]
                line += (
                    " teacher-forced "
                    + ", ".join(
                        f"mask {row['mask_fraction']}: rel {_f(row['max_rel'])}, cos {row['min_cosine']:.6f}, "
                        f"argmax {row['argmax_agreement']:.3f}"
                        for row in tf["rows"]
                    )
                    + f" ({'pass' if tf['passed'] else 'FAIL'})"
                )
            out.append(line)
            out += [f"- {check}: FAIL, raised {res['error']}" for check, res in errors.items()]
            if "decisions" in checks:
                d = checks["decisions"]
                out.append(
                    f"- decisions: {d['steps']} steps, min Jaccard {d['min_jaccard']:.3f}, "
                    f"{len(d['violations'])} near-tie violations ({'pass' if d['passed'] else 'FAIL'})"
                )
            edit = checks.get("decisions (joint_threshold)")
            if edit is not None:  # the editing rule: boundary probes and lock-step decisions vs its oracle
                d = edit["decisions"]
                probes = sum(len(c["violations"]) for c in edit["probes"]["cases"])
                out.append(
                    f"- joint_threshold decisions: {d['steps']} steps, {d['oracle_edits']} edits, "
                    f"{d['near_ties']} near ties, {len(d['violations'])} violations, {probes} probe mismatches "
                    f"({'pass' if edit['passed'] else 'FAIL'})"
                )
            if "free_running" in checks:
                fr = checks["free_running"]
                out.append(
                    f"- free-running greedy: exact match {fr['exact_match']:.3f}, first divergence "
                    f"{fr['first_divergence']} ({'pass' if fr['passed'] else 'FAIL'})"
                )
            if "accuracy" in checks:
                a = checks["accuracy"]
                out.append(
                    f"- task accuracy {a['accuracy']:.3f} vs reference {a['reference_accuracy']:.3f} on "
                    f"{a['n']} items ({'pass' if a['passed'] else 'FAIL'})"
                )
            out.append("")
        p = r["performance"]
        out += ["### Performance (embedded model)", ""]
        if "skipped" in p:
            out.append(p["skipped"])
        elif "error" in p:
            out.append(f"not measured: raised {p['error']}")
        else:
            out += [
                "| " + " | ".join(p) + " |",
                "|" + "---|" * len(p),
                "| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in p.values()) + " |",
            ]
    return "\n".join(out) + "\n"
