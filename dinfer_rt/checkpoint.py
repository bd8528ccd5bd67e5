"""Lazy safetensors reading: validated headers, sharded indexes, one tensor at a time.

Headers are parsed and checked here (so a corrupt or truncated file gets an error that
names it), then tensors are read through ``safetensors.safe_open``, which memory-maps
the file: loading converts one tensor at a time and never holds the checkpoint twice.
"""

from __future__ import annotations

import json
import stat
import struct
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from dinfer_rt.errors import CheckpointError

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
# safetensors dtypes that are no weight format this runtime loads: refused at the header, naming the tensor.
_REFUSED_DTYPES = {
    "F8_E8M0": "an MX block-scale format",
    "F6_E2M3": "a packed 6-bit float format",
    "F6_E3M2": "a packed 6-bit float format",
    "F4": "a packed 4-bit float format",
    "C64": "a complex format",
}
# fp8 weights are read as bfloat16, which holds every E4M3 / E5M2 value exactly (8 exponent bits,
# 7 mantissa bits): the dtype conversion and the NaN scan then work as for any 16-bit checkpoint.
_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
_MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> dict[str, dict]:
    """Parse and check a safetensors header; returns ``{tensor: {dtype, shape, data_offsets}}``."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or stream forever
            raise CheckpointError(f"{path}: is not a regular file")
        size = st.st_size
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})"
                )
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if isinstance(dtype, str) and dtype not in _DTYPE_BYTES:
            what = _REFUSED_DTYPES.get(dtype)
            if what is not None:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has dtype {dtype} ({what}), which dinfer-rt does not load; "
                    "convert the checkpoint to bfloat16 / float16 / float32 (or fp8 E4M3 / E5M2)"
                )
            raise CheckpointError(f"{path}: tensor {name!r} has unknown safetensors dtype {dtype[:40]!r}")
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not all(_count(d) for d in shape) or not (_count(start) and _count(end)):
                raise ValueError("shape and data_offsets must hold non-negative integers")
            numel = 1
            for d in shape:
                numel *= d
            want = numel * _DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            entry = repr(info)
            entry = entry if len(entry) <= 200 else entry[:200] + "..."
            raise CheckpointError(
                f"{path}: corrupt safetensors header entry for tensor {name!r} (needs dtype, shape: a list of "
                f"non-negative integers, data_offsets: [start, end] non-negative integers): {entry}"
            ) from None
        if end - start != want:
            raise CheckpointError(
                f"{path}: tensor {name!r} has {end - start} bytes, its shape {shape} {dtype} needs {want}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {end} of a {data_size}-byte data section"
            )
    return header


def _count(v) -> bool:
    """A non-negative int (JSON's true / false are no sizes)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class Checkpoint:
    """The tensors of a model folder: ``model.safetensors``, or shards listed by an index."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self.files: dict[str, Path] = {}  # tensor name -> file
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.bytes_read = 0  # tensor bytes read so far (slices count what they read)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            shard_names = self._read_index(index)
        else:
            shard_names = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not shard_names:
                raise CheckpointError(f"{model_dir}: no *.safetensors file and no model.safetensors.index.json")
        for shard in shard_names:
            path = model_dir / shard
            for name, info in read_header(path).items():
                if name in self.files:
                    raise CheckpointError(f"{path}: tensor {name!r} also stored in {self.files[name]}")
                self.files[name] = path
                self.shapes[name] = tuple(info["shape"])
        if index.is_file():
            self._check_index_agrees(index)

    def _read_index(self, index: Path) -> list[str]:
        try:
            text = index.read_text(encoding="utf-8")
        except OSError as e:
            raise CheckpointError(f"{index}: cannot read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (not UTF-8 text: {e.reason} at byte "
                                  f"{e.start})") from None  # fmt: skip
        try:
            data = json.loads(text)
            self._weight_map: dict[str, str] = dict(data["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}"
            ) from None
        for name, shard in self._weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(
                    f"{index}: 'weight_map' gives tensor {name!r} the shard {shard!r}; shard names must be file "
                    "names (strings)"
                )
            if shard != Path(shard).name or shard in (".", ".."):
                raise CheckpointError(
                    f"{index}: 'weight_map' gives tensor {name!r} the shard {shard!r}; shards must be files in the "
                    "model folder, named without a path"
                )
        shards = sorted(set(self._weight_map.values()))
        for shard in shards:
            if not (self.dir / shard).is_file():
                users = sorted(k for k, v in self._weight_map.items() if v == shard)
                raise CheckpointError(
                    f"{index}: shard {shard!r} is missing (it holds {len(users)} tensors, e.g. {users[0]!r})"
                )
        return shards

    def _check_index_agrees(self, index: Path) -> None:
        for name, shard in self._weight_map.items():
            got = self.files.get(name)
            if got is None or got.name != shard:
                where = "in no shard" if got is None else f"in {got.name}"
                raise CheckpointError(f"{index}: lists tensor {name!r} in {shard!r}, but it is {where}")

    def names(self) -> set[str]:
        return set(self.files)

    def read(
        self, names: list[str], slices: dict[str, tuple[int, list[tuple[int, int]]]] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield tensors one at a time, grouped by file (each file opened once, memory-mapped).
        ``slices[name] = (dim, [(lo, hi), ...])`` reads only those ranges of dim 0 or 1,
        concatenated (safetensors' ``get_slice``: a tensor-parallel rank reads its shard, not the
        whole tensor; a fused QKV weight gives three ranges)."""
        slices = slices or {}
        from safetensors import SafetensorError, safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        for path, group in by_file.items():
            with ExitStack() as stack:
                try:
                    fh = stack.enter_context(safe_open(str(path), framework="pt"))
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{path}: cannot open as safetensors ({e})") from None
                for n in group:
                    if n in slices:
                        dim, ranges = slices[n]
                        view = fh.get_slice(n)
                        parts = [view[lo:hi] if dim == 0 else view[:, lo:hi] for lo, hi in ranges]
                        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
                    else:
                        t = fh.get_tensor(n)
                    self.bytes_read += t.numel() * t.element_size()
                    yield n, (t.to(torch.bfloat16) if t.dtype in _FP8 else t)
