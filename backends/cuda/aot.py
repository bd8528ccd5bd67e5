"""Ahead-of-time builds of the shared Triton kernels for NVIDIA targets (``cuda:sm_80``,
``cuda:sm_90``; no GPU needed): registers, spills and shared memory per kernel from ``ptxas -v``
on the generated PTX, with this folder's tuning rows."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from dinfer_rt.backends.cuda.tuning import AOT_TARGETS, table
from dinfer_rt.backends.triton.aot import compile_each
from dinfer_rt.errors import BackendError


def compile_ptx(arch: str) -> list[dict]:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    cc = AOT_TARGETS[arch]
    target = f"cuda:{arch}"
    ptxas = get_ptxas(cc).path

    def resources(name: str, compiled) -> dict:
        with tempfile.TemporaryDirectory() as d:
            ptx = Path(d) / f"{name}.ptx"
            ptx.write_text(compiled.asm["ptx"])
            gpu = f"--gpu-name=sm_{cc}a" if cc == 90 else f"--gpu-name=sm_{cc}"
            out = subprocess.run(
                [ptxas, "-v", gpu, str(ptx), "-o", str(Path(d) / "k.cubin")], capture_output=True, text=True
            )
        if out.returncode != 0:
            raise BackendError(f"ptxas failed on {name} for {target}: {out.stderr.strip()[-300:]}")
        log = out.stderr + out.stdout
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        return {
            "registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else None,
            "spill_loads": int(spill.group(2)) if spill else None,
            "shared_bytes": compiled.metadata.shared,
        }

    return compile_each(target, table(arch), "bf16", GPUTarget("cuda", cc, 32), resources)


def targets() -> dict:
    """``{"cuda:sm_NN": compile}`` for the ``dinfer_rt_compile_targets`` hook."""
    return {f"cuda:{arch}": (lambda arch=arch: compile_ptx(arch)) for arch in AOT_TARGETS}
