"""docs/porting.md is followed literally by porters: its package builds, and what it says about
proving a port names the commands that exist."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parents[1] / "docs" / "porting.md").read_text()


def _block(lang: str, first_line: str) -> str:
    found = re.search(rf"```{lang}\n{re.escape(first_line)}\n(.*?)```", DOC, re.S)
    assert found, f"no {lang} block starting {first_line!r} in docs/porting.md"
    return found.group(1)


def test_the_guides_pyproject_builds_a_wheel_with_the_entry_point(tmp_path):
    toml = _block("toml", "# pyproject.toml")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads(toml)
    assert meta["project"]["version"] and meta["build-system"]["build-backend"] == "setuptools.build_meta"
    pytest.importorskip("setuptools")
    pkg = tmp_path / "pkg"
    (pkg / "dinfer_rt_mychip").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(toml)
    (pkg / "dinfer_rt_mychip" / "__init__.py").write_text("")
    (pkg / "dinfer_rt_mychip" / "plugin.py").write_text(_block("python", "# dinfer_rt_mychip/plugin.py"))
    out = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(pkg)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = out.glob("dinfer_rt_mychip-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as z:
        eps = next(n for n in z.namelist() if n.endswith("entry_points.txt"))
        assert "[dinfer_rt.backends]\nmychip = dinfer_rt_mychip.plugin" in z.read(eps).decode()


def test_proving_the_port_names_validate_and_the_pytest_form():
    section = DOC.split("## 6. Proving the port", 1)[1]
    assert "`dinfer-rt validate --backends mychip --quick`" in section
    assert "`pytest --pyargs dinfer_rt.validation --dinfer-backend=mychip`" in section
    assert "DINFER_PLUGINS=mychip,reference" in section  # validate's oracle under an allowlist


def test_the_contract_count_matches_its_bullets():
    words = {"Two": 2, "Three": 3, "Four": 4}
    head, rest = re.split(r"\b(Two|Three|Four)\s+contracts need care:", DOC)[1:3]
    body = rest.split("\n## ", 1)[0]
    assert len(re.findall(r"^- ", body, re.M)) == words[head]


def test_the_fault_rules_are_documented():
    section = DOC.split("## 2. The hooks", 1)[1].split("## 3.", 1)[0]
    assert "at backend selection" in section and "do not show these faults" in section
    assert "the first registration of a name stays" in section
    assert "did you mean 'dinfer_rt_register_kernels'?" in section
    assert "closest IR ops" in DOC.split("## 3.", 1)[1]
    assert "emulation()" in DOC and "simulated on the CPU" in DOC
