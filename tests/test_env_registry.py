"""Every ``DINFER_*`` variable the runtime reads is in ``envs.ALL`` (what ``dinfer-rt env``
lists) and in the README's table, so a user can find it: the sources are scanned for the names
they spell, so a variable added without registering it fails here."""

from __future__ import annotations

import re
from pathlib import Path

from dinfer_rt import envs, hub

ROOT = Path(__file__).resolve().parents[1]
NOT_USER_SETTINGS = {
    "DINFER_RT_HOOK_API": "a plugin module's attribute, not an environment variable",
    "DINFER_RENDEZVOUS": "set by parallel.launch for the ranks it starts, never by a user",
}


def _spelled() -> set[str]:
    names = set()
    for folder in ("dinfer_rt", "backends"):
        for f in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](DINFER_[A-Z0-9_]+)[\"']", f.read_text()))
    return names - set(NOT_USER_SETTINGS)


def test_every_variable_read_is_registered_and_documented():
    spelled = _spelled()
    assert "DINFER_USE_MODELSCOPE" in spelled  # the scan sees a name spelled outside envs.py (hub.py)
    assert spelled - set(envs.ALL) == set(), "read but not in envs.ALL"
    readme = (ROOT / "README.md").read_text()
    assert [n for n in envs.ALL if f"| `{n}` |" not in readme] == [], "in envs.ALL but not in the README's table"
    assert hub.DINFER_USE_MODELSCOPE == envs.DINFER_USE_MODELSCOPE
