"""Who a backend's device is: identity, the availability probe and capabilities.

This is what vLLM's ``Platform`` holds and nothing more: no kernels, passes or launch
parameters (those are :class:`dinfer_rt.backend.Backend`'s). ``dinfer-rt backends`` and the
selection error messages only ever need this part.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from dinfer_rt.envs import shown


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Capabilities:
    dtypes: tuple[torch.dtype, ...]
    warp_size: int | None = None
    collectives: str | None = None  # torch.distributed backend for this device (gloo, nccl, hccl)
    weight_formats: tuple[str, ...] = ()  # quantised weight formats with kernels here (int8, fp8, gptq4)
    extra: dict[str, object] = field(default_factory=dict)


class Platform:
    """Identity of a device family. Subclasses set the class attributes.

    A choice ``name:flavour:arch`` sets ``flavour`` and ``arch`` on the instance before
    :meth:`validate_choice` and :meth:`is_available` run. ``is_available`` must be cheap and
    must never initialise a device runtime; :meth:`identify` runs once after selection and may.
    """

    name: str = "?"
    flavour: str = "default"
    arch: str | None = None
    device_type: str = "cpu"
    priority: int = 0  # auto-detect picks the available backend with the highest priority

    def is_available(self) -> Availability:
        """An :class:`Availability` (anything else, a bare ``True`` included, leaves the backend
        unavailable as its plugin's fault: ``dinfer_rt.plugins.availability``)."""
        return Availability(True, "ok")

    def validate_choice(self) -> str | None:
        """Why the flavour/arch named in the choice (``name:flavour:arch``) is invalid, or None."""
        return None

    def choice_problem(self, flavours: Collection[str], archs: Collection[str] = ()) -> str | None:
        """For :meth:`validate_choice`: why the chosen flavour is none of ``flavours`` or the
        chosen arch none of ``archs`` (empty: the backend takes no arch), or None. Values are cut
        (:func:`dinfer_rt.envs.shown`): they come from the environment."""
        if self.flavour not in flavours:
            its = (
                f"its flavour is {next(iter(flavours))!r}"
                if len(flavours) == 1
                else f"its flavours: {', '.join(flavours)}"
            )
            return f"backend {self.name} has no flavour {shown(self.flavour)}; {its}"
        if self.arch is not None and self.arch not in archs:
            if not archs:
                return f"backend {self.name} takes no arch (got {shown(self.arch)})"
            return f"backend {self.name} has no arch {shown(self.arch)}; known: {', '.join(archs)}"
        return None

    def identify(self) -> None:
        """Fill in what only the device can tell (arch, flavour); called once after selection."""

    def capabilities(self) -> Capabilities:
        return Capabilities(dtypes=(torch.float32,))

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}

    def emulation(self) -> str | None:
        """What stands in for the device when its kernels run emulated (an interpreter, a
        simulated runtime), or None on the real thing: results stay valid, timings measure the
        stand-in, so ``validate`` reports no performance for it."""
        return None

    def describe(self) -> str:
        arch = f":{self.arch}" if self.arch else ""
        return f"{self.name}:{self.flavour}{arch}"
