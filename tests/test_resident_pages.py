"""dinfer_rt.resident_pages: merged weights' memory-mapped sources are handed back, values unchanged."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dinfer_rt.resident_pages import page_out


def _rss_file_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_page_out_drops_a_memory_mapped_tensor_from_the_resident_set_and_keeps_its_values(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(16 << 20, dtype=torch.float32)}, str(path))  # 64 MB
    with safe_open(str(path), framework="pt") as fh:
        t = fh.get_tensor("w")
    total = float(t.sum())  # every page read: resident
    resident = _rss_file_mb()
    assert page_out([t]) >= 60 << 20
    assert _rss_file_mb() < resident - 50  # the mapping's pages went back
    assert float(t.sum()) == total  # and come back from the file unchanged when read


def test_page_out_is_harmless_on_anonymous_memory_and_tiny_tensors():
    a = torch.randn(1 << 20)
    before = a.clone()
    page_out([a, torch.ones(3), torch.empty(0)])
    assert torch.equal(a, before)
