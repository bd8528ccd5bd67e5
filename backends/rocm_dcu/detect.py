"""Which HIP-family device this is, without trusting the torch device type (docs/backends/rocm_dcu.md).

``probe`` runs before selection and never initialises the HIP runtime: ``torch.version.hip``
and the vendor tools on PATH. ``identify`` runs after selection, on the device properties
(``name``, ``gcnArchName``), and picks the flavour and the capability/tuning record.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from dinfer_rt.backends.rocm_dcu.tuning import ARCHS, DEFAULT_ARCH

_HYGON_NAME = re.compile(r"hygon|\bdcu\b|\bhcu\b|\bK100|\bK500|\bZ100|\bBW1\d00", re.IGNORECASE)
_AMD_NAME = re.compile(r"\bAMD\b|Instinct|\bMI\d{3}|Radeon", re.IGNORECASE)


@dataclass(frozen=True)
class Identity:
    flavour: str  # "hygon" | "amd"
    arch: str  # gfxNNN with a tuning row
    how: str  # the evidence, for `dinfer-rt backends` and reports


def vendor_tool(which: Callable[[str], str | None]) -> str | None:
    """ "hygon" when ``hy-smi`` is on PATH, "amd" when only ``rocm-smi`` is, else None."""
    if which("hy-smi"):
        return "hygon"
    if which("rocm-smi"):
        return "amd"
    return None


def arch_of(gcn_arch_name: str) -> str:
    """'gfx928:sramecc+:xnack-' -> 'gfx928'."""
    return gcn_arch_name.split(":")[0].strip()


def identify(name: str, gcn_arch_name: str, which: Callable[[str], str | None]) -> Identity:
    """Flavour from the device name, else the vendor tool, else the arch's own vendor; the
    tuning arch is the reported one when we have a row for it, else the flavour's default."""
    arch = arch_of(gcn_arch_name)
    if _HYGON_NAME.search(name):
        flavour, how = "hygon", f"device name {name!r}"
    elif _AMD_NAME.search(name):
        flavour, how = "amd", f"device name {name!r}"
    elif (tool := vendor_tool(which)) is not None:
        flavour, how = tool, "hy-smi on PATH" if tool == "hygon" else "rocm-smi on PATH (no hy-smi)"
    elif arch in ARCHS:
        flavour, how = ARCHS[arch].vendor, f"arch {arch} is a {ARCHS[arch].vendor} arch"
    else:
        flavour, how = "amd", "no Hygon evidence"
    if arch not in ARCHS:
        fallback = DEFAULT_ARCH[flavour]
        return Identity(flavour, fallback, f"{how}; no tuning row for {arch or '?'}, using {fallback}'s")
    return Identity(flavour, arch, f"{how}; arch {arch}")
