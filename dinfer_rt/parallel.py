"""Tensor parallelism on torch.distributed: weight slices per rank, the process group the IR's
collectives use, and a launcher for N worker processes on one machine.

The collective library is the backend's (``Capabilities.collectives``: gloo on the CPU, NCCL on
NVIDIA, RCCL through torch's "nccl" on ROCm, HCCL on Ascend). Every rank runs the same scheduler
on the same all-reduced outputs, so every rank takes the same decisions (all-reduce leaves the
same bytes on every rank); rank 0's results are returned.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import io
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dinfer_rt.errors import DinferError
from dinfer_rt.ir import ops
from dinfer_rt.passes.shard import TensorParallel, check_split


class ParallelError(DinferError):
    """A worker rank failed, died or hung: the message names the rank."""


RENDEZVOUS_ENV = "DINFER_RENDEZVOUS"
"""A ``file://`` rendezvous ``launch`` gives its ranks (no port to pick: a port found free and
released before the ranks bind it could be taken meanwhile by a concurrent run)."""


def init_group(
    backend_name: str | None, rank: int, world: int, tp_size: int | None = None, timeout_s: float | None = None
) -> None:
    """Join the default process group (``launch``'s file rendezvous, else env:// : MASTER_ADDR /
    MASTER_PORT, as torchrun sets them) with the backend's collective library, bind this rank to
    its device (``LOCAL_RANK``, else ``rank``, among the visible ones: ``CUDA_VISIBLE_DEVICES`` /
    ``HIP_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``), and make the group the one the IR's
    collectives use. ``timeout_s`` bounds how long a collective waits for a peer (default torch's)."""
    import torch.distributed as dist

    from dinfer_rt.plugins import select_backend

    backend = select_backend(backend_name)
    check_devices(backend, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    library = (backend.capabilities().collectives or "gloo").split()[0]
    bind_device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(library, rank=rank, world_size=world, init_method=os.environ.get(RENDEZVOUS_ENV), **kw)
        atexit.register(leave_group, wait=False)
    tp = tp_size or world
    if tp == world:
        ops.COLLECTIVE_GROUPS["tp"] = dist.group.WORLD
        return
    mine = None
    for replica in range(world // tp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(replica * tp, (replica + 1) * tp)))
        if replica == rank // tp:
            mine = group
    if tp == 1:
        ops.COLLECTIVE_GROUPS.pop("tp", None)  # a replica of one rank: collectives are the identity
    else:
        ops.COLLECTIVE_GROUPS["tp"] = mine


BEFORE_LEAVING: list[Callable[[], None]] = []
"""Called first by ``leave_group``: a group's lead releases the ranks that follow it
(``model_runner.LeadRunner.stop``), else they would wait in a collective while it waits at the
barrier."""


def leave_group(wait: bool = True) -> None:
    """Leave every process group while the interpreter is still whole: wait for the other ranks
    (``wait``), drop the IR's references to the groups and destroy them.

    Why: gloo's worker threads release a finished collective's tensors (a Python decref) a little
    after the collective returns. A group that outlives ``destroy_process_group`` (the IR holds it
    in ``COLLECTIVE_GROUPS``) keeps those threads running into interpreter shutdown, where that
    decref aborts the process ("terminate called without an active exception", SIGABRT).
    Dropping the last reference joins the threads here. Idempotent; registered at exit by
    ``init_group``."""
    import torch.distributed as dist

    while BEFORE_LEAVING:
        try:
            BEFORE_LEAVING.pop()()
        except Exception:  # a peer already gone: nothing to release
            pass
    ops.COLLECTIVE_GROUPS.clear()
    if dist.is_initialized():
        try:
            if wait:
                dist.barrier()
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to coordinate
            pass
    gc.collect()  # a group caught in a reference cycle is freed (and its threads joined) now


group_size = ops.group_size  # ranks in the group the IR's collectives use (1: none)

_VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def bind_device(backend, local_rank: int) -> None:
    """One device per process on this machine: the ``local_rank``-th visible one (no-op on the CPU)."""
    devices = getattr(torch, backend.device_type, None) if backend.device_type != "cpu" else None
    if devices is not None and hasattr(devices, "set_device"):
        devices.set_device(local_rank % max(1, devices.device_count()))


def check_devices(backend, ranks_here: int) -> None:
    """One device per rank: more ranks on this machine than the backend's visible devices is a
    one-line error (before any process starts or any weight is read). CPU ranks share the host."""
    kind = backend.device_type
    if kind == "cpu":
        return
    devices = getattr(torch, kind, None)
    count = devices.device_count() if devices is not None and hasattr(devices, "device_count") else 0
    if ranks_here > count:
        raise ParallelError(
            f"{ranks_here} ranks on this machine but backend {backend.name} sees {count} {kind} device(s) "
            f"(one device per rank; visibility: {_VISIBLE.get(kind, 'the device runtime')})"
        )


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or ``taskset``'s limit), not
    the machine's count: threads sized from ``os.cpu_count()`` under ``taskset -c 0`` would
    thrash one core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return os.cpu_count() or 1


def threads_per_process(processes: int) -> int:
    """torch threads for each of ``processes`` processes sharing this process's CPUs."""
    return max(1, usable_cpus() // processes)


@contextlib.contextmanager
def sigint_ignored():
    """Processes started inside this block inherit an ignored SIGINT (it is kept through exec, and
    Python then installs no KeyboardInterrupt handler): a terminal's Ctrl-C reaches the whole
    process group, and the workers leave it to their parent, which drains or stops them, instead
    of each printing a traceback. Only the main thread can change signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _worker(rank, world, rendezvous, backend, fn, args, results, tp_size) -> None:
    os.environ.update({RENDEZVOUS_ENV: rendezvous, "RANK": str(rank), "WORLD_SIZE": str(world)})
    torch.set_num_threads(threads_per_process(world))
    try:
        init_group(backend, rank, world, tp_size)
        value = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # by value: a shared-memory tensor would vanish with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # every failure goes to the parent, named by rank
        where = traceback.extract_tb(e.__traceback__)[-1]
        results.put((rank, "error", f"{type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"))
    finally:
        leave_group(wait=False)


def launch(
    world: int,
    fn: Callable,
    *args: Any,
    backend: str | None = None,
    timeout: float = 300.0,
    tp_size: int | None = None,
    all_ranks: bool = False,
) -> Any:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes joined in one process group;
    return rank 0's result (``all_ranks``: every rank's, in rank order). ``tp_size`` < ``world``
    splits the ranks into ``world // tp_size`` tensor-parallel groups (data-parallel replicas);
    the IR's collectives then run within a rank's own group. A rank that raises, dies or does not
    finish within ``timeout`` seconds ends every rank with one error naming it. ``fn`` must be
    importable (a module-level function)."""
    if tp_size is not None and (tp_size < 1 or world % tp_size):
        raise ParallelError(f"{world} ranks do not split into tensor-parallel groups of {tp_size}")
    if world < 1:
        raise ParallelError(f"tensor parallel size must be >= 1, got {world}")
    from dinfer_rt.plugins import select_backend

    check_devices(select_backend(backend), world)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.mkdtemp(prefix="dinfer-rendezvous-")
    rendezvous = "file://" + os.path.join(store, "store")  # a fresh file: torch's FileStore needs one
    procs = [
        ctx.Process(target=_worker, args=(r, world, rendezvous, backend, fn, args, results, tp_size), daemon=True)
        for r in range(world)
    ]
    with sigint_ignored():
        for p in procs:
            p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in got and p.exitcode not in (None, 0):
                        raise ParallelError(f"rank {r} died (exit code {p.exitcode}) before returning") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(got))
                    raise ParallelError(f"rank(s) {missing} did not finish within {timeout:.0f} s (hung?)") from None
                continue
            if status == "error":
                raise ParallelError(f"rank {rank} failed: {value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        shutil.rmtree(store, ignore_errors=True)
    if all_ranks:
        return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]
    return torch.load(io.BytesIO(got[0]), weights_only=False)


# ---------------------------------------------------------------- workers (module level: spawnable)


def load_sharded(
    path, rank: int, world: int, backend: str | None = None, dtype: str | None = None, expert_parallel: bool = False
):
    from dinfer_rt.loader import load_model

    tp = (rank, world)
    return load_model(path, backend=backend, dtype=dtype, tensor_parallel=tp, expert_parallel=expert_parallel)


def forward_worker(
    rank: int, world: int, path, input_ids: torch.Tensor, block_size: int | None = None, expert_parallel: bool = False
):
    """Logits of one forward of the sharded model (every rank computes them; rank 0's return)."""
    model = load_sharded(path, rank, world, expert_parallel=expert_parallel)
    return model.forward(input_ids, block_size=block_size)


__all__ = [
    "ParallelError",
    "TensorParallel",
    "bind_device",
    "check_devices",
    "check_split",
    "group_size",
    "init_group",
    "launch",
    "leave_group",
]
