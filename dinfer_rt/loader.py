"""``load_model``: model folder -> verified graph + weights on a backend."""

from __future__ import annotations

from pathlib import Path

import torch

from dinfer_rt import envs
from dinfer_rt.checkpoint import Checkpoint
from dinfer_rt.dtypes import resolve_dtype
from dinfer_rt.errors import ConfigError
from dinfer_rt.hub import resolve_model
from dinfer_rt.model import Model
from dinfer_rt.model_spec import parse_spec
from dinfer_rt.plugins import select_backend
from dinfer_rt.tokenizer import Tokenizer, generation_eos_ids, require_file

EMBEDDED_MODEL = Path(__file__).parent / "demo" / "model"


def default_model_path() -> Path:
    """``DINFER_MODEL`` if set (a folder, or a hub id resolved to its cached snapshot), else the
    embedded model shipped in the package."""
    env = envs.get(envs.DINFER_MODEL)
    return resolve_model(env, what=envs.DINFER_MODEL) if env else EMBEDDED_MODEL


def model_folder(path: str | Path | None, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The folder a ``model`` argument names: a local folder as given, a hub id (``ORG/NAME``)
    downloaded or found in the hub cache (``dinfer_rt.hub``), None for ``default_model_path()``."""
    if path is None:
        if revision is not None or download_dir is not None:
            env = envs.get(envs.DINFER_MODEL)
            if env:
                return resolve_model(env, revision, download_dir, what=envs.DINFER_MODEL)
            raise ConfigError("--revision / --download-dir apply to hub ids: pass --model ORG/NAME")
        return check_folder_files(default_model_path())
    return check_folder_files(resolve_model(path, revision, download_dir))


def check_folder_files(folder: Path) -> Path:
    """A config.json that is there but is a folder, a symlink loop or a dangling symlink is named
    as such (a missing one is left to ``parse_spec``'s message)."""
    cfg = folder / "config.json"
    if folder.is_dir() and (cfg.is_symlink() or cfg.exists()):
        require_file(cfg, "config.json", ConfigError, "")
    return folder


def check_special_tokens(model_dir: Path, spec, tok: Tokenizer) -> None:
    """config.json's mask and pad ids must be the tokens tokenizer_config.json names: the
    scheduler writes the mask id into every undecided slot and the pad id into padding, so a
    contradiction would silently decode nonsense. Its BOS and EOS ids may differ: Dream-7B's BOS
    does, and only the tokenizer's BOS is ever rendered or scored; instruct models name the
    end-of-turn token as EOS, and every such id ends a generation. A BOS or EOS token
    tokenizer_config.json names must be in tokenizer.json: a chat template renders it as text,
    which would otherwise be split into plain characters. (Its mask token may be missing when
    config.json gives the id: SDAR's files spell it differently.)"""
    cfg = model_dir / "tokenizer_config.json"
    for key in ("bos_token", "eos_token"):  # templates render them as text: absent, they would be split into letters
        text = tok.specials.get(key)
        if text is not None and tok.special_id(key) is None:
            raise ConfigError(f"{cfg}: field {key!r} = {text!r} is not a token of {model_dir / 'tokenizer.json'}")
    mask = tok.specials.get("mask_token")
    if spec.mask_id is None and mask is not None and tok.special_id("mask_token") is None:
        raise ConfigError(
            f"{cfg}: field 'mask_token' = {mask!r} is not a token of {model_dir / 'tokenizer.json'}, and "
            f"{model_dir / 'config.json'} has no 'mask_token_id': the model has no mask id"
        )
    for field, key, ours in (  # not BOS: Dream-7B's config says 151643, its tokenizer <|beginoftext|> 151665,
        ("mask_token_id", "mask_token", spec.mask_id),  # and nothing here reads config.json's BOS id
        ("pad_token_id", "pad_token", spec.pad_id),
    ):
        named = tok.special_id(key)
        if ours is not None and named is not None and named != ours:
            raise ConfigError(
                f"{model_dir / 'config.json'}: field {field!r} = {ours} contradicts "
                f"{model_dir / 'tokenizer_config.json'}: {key} {tok.config.get(key)!r} is id {named}"
            )


def checked_generation_eos(model_dir: Path, spec) -> tuple[int, ...]:
    """generation_config.json's ``eos_token_id`` (an id or a list), each inside the vocabulary:
    instruct checkpoints name their end-of-turn token only there (SDAR's ``<|im_end|>``)."""
    ids = generation_eos_ids(model_dir)
    for i in ids:
        if i >= spec.vocab:
            raise ConfigError(
                f"{model_dir / 'generation_config.json'}: field 'eos_token_id' = {i} is outside the vocabulary "
                f"({spec.vocab} rows)"
            )
    return ids


def auto_dtype(spec, backend) -> torch.dtype:
    """``dtype="auto"``: the checkpoint's ``torch_dtype`` where the backend computes on a device
    and supports it; float32 on the CPU (and where the checkpoint names none)."""
    if backend.device().type == "cpu":
        return torch.float32
    named = spec.config.get("torch_dtype")
    try:
        dt = resolve_dtype(named) if isinstance(named, str) else torch.float32
    except ConfigError as e:  # the user passed no dtype: name the field that gave this one
        raise ConfigError(
            f"config.json: field 'torch_dtype' = {named!r} ({e}); --dtype / dtype= picks one instead"
        ) from None
    return dt if dt in backend.capabilities().dtypes else torch.float32


def load_model(
    path: str | Path | None = None,
    backend: str | None = None,
    dtype: str | torch.dtype | None = "auto",
    *,
    tokenizer: bool = True,
    disable_passes: tuple[str, ...] | list[str] = (),
    check_weights: bool = True,
    tensor_parallel: tuple[int, int] | None = None,
    quantization: str | None = None,
    expert_parallel: bool = False,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    chat_template_name: str | None = None,
) -> Model:
    """Load a checkpoint folder (config.json + safetensors + tokenizer.json), or a hub id
    (``ORG/NAME``, at ``revision``, cached in ``download_dir`` or the hub library's cache;
    ``docs/models.md``). A local folder of the same spelling always wins.

    ``backend`` overrides ``DINFER_BACKEND``. ``dtype`` (float32 / bfloat16 / float16 /
    float64) is the conversion applied as each tensor is read; ``"auto"`` (the default, as in
    vLLM) is the checkpoint's own ``torch_dtype`` on a device backend and float32 on the CPU
    (where 16-bit matmuls are slow and the reference is fp32). ``disable_passes`` names graph
    passes to skip for this model (e.g. to build an unfused twin). ``check_weights`` scans
    every weight for NaN / infinity at load (off for trusted checkpoints). ``tensor_parallel``
    ``(rank, world)`` loads rank ``rank``'s shard (``dinfer_rt.parallel``; the process group must
    be initialised, as ``dinfer_rt.parallel.launch`` does); its MoE layers split each routed
    expert's intermediate size, or with ``expert_parallel`` whole experts. ``quantization`` ("int8", "fp8")
    quantises the decoder projections as they are read (weight-only, per output channel) and keeps
    only the quantised copies; a GPTQ checkpoint (config.json ``quantization_config``) loads in
    its packed 4-bit layout without it (``docs/quantization.md``). ``chat_template_name`` picks one
    of the named templates when tokenizer_config.json's ``chat_template`` is a list of them.
    """
    _check_arguments(
        path=path, backend=backend, dtype=dtype, tokenizer=tokenizer, disable_passes=disable_passes,
        check_weights=check_weights, tensor_parallel=tensor_parallel, quantization=quantization,
        expert_parallel=expert_parallel, revision=revision, download_dir=download_dir,
        chat_template_name=chat_template_name,
    )  # fmt: skip
    model_dir = model_folder(path, revision, download_dir)
    spec = parse_spec(model_dir)
    tp = None
    if tensor_parallel is not None and tensor_parallel[1] > 1:
        from dinfer_rt.ir.ops import group_size
        from dinfer_rt.passes.shard import TensorParallel, check_split

        rank, world = tensor_parallel
        check_split(spec, world, expert_parallel)  # before any weight is read
        if group_size() != world:
            raise ConfigError(
                f"tensor_parallel={tensor_parallel}: the process group has {group_size()} rank(s), not {world}; "
                "start the ranks with dinfer_rt.parallel.launch (or torchrun) and init_group first"
            )
        tp = TensorParallel(rank, world, expert_parallel)
    be = select_backend(backend)
    dt = auto_dtype(spec, be) if dtype in (None, "auto") else resolve_dtype(dtype)
    if dt not in be.capabilities().dtypes:
        from dinfer_rt.errors import BackendError

        raise BackendError(f"backend {be.name} does not support dtype {dt}; it supports {be.capabilities().dtypes}")
    fmt = _weight_format(model_dir, spec, be, quantization, tp)
    tok = Tokenizer(model_dir, spec.vocab, chat_template_name=chat_template_name) if tokenizer else None
    generation_eos = checked_generation_eos(model_dir, spec)
    if tok is not None:
        check_special_tokens(model_dir, spec, tok)
    weights = Checkpoint(model_dir)
    from dinfer_rt.weights import load_weights

    w = load_weights(weights, spec, dt, check_weights, tp, quantization, device=be.device())
    model = Model(model_dir, spec, w, tok, be, dt, tuple(disable_passes), tensor_parallel=tp, weight_format=fmt)
    model.bytes_read = weights.bytes_read  # what this process read from the checkpoint files
    model.generation_eos_ids = generation_eos  # generation_config.json's stop ids (docs/models.md)
    model.executable(cached=False)  # lower, verify and compile now: errors surface at load
    return model


_OPTIONAL_TEXT = (str, type(None))
_KINDS = {  # load_model's keyword -> (accepted types, what the message asks for)
    "path": ((str, Path, type(None)), "a folder, a hub id (ORG/NAME) or None"),
    "backend": (_OPTIONAL_TEXT, "a backend name or None"),
    "dtype": ((str, torch.dtype, type(None)), "a dtype name, a torch.dtype or None"),
    "tokenizer": ((bool,), "True or False"),
    "disable_passes": ((tuple, list), "a list of pass names"),
    "check_weights": ((bool,), "True or False"),
    "tensor_parallel": ((tuple, type(None)), "(rank, world) or None"),
    "quantization": (_OPTIONAL_TEXT, "'int8', 'fp8' or None"),
    "expert_parallel": ((bool,), "True or False"),
    "revision": (_OPTIONAL_TEXT, "a branch, tag or commit, or None"),
    "download_dir": ((str, Path, type(None)), "a folder or None"),
    "chat_template_name": (_OPTIONAL_TEXT, "a template name or None"),
}


def _check_arguments(**args) -> None:
    """``load_model``'s arguments have the types it documents: a slip (``backend=5``, a string of
    pass names, an empty path that would mean the current folder) is one error naming the
    argument, not a failure deep inside loading."""
    for name, value in args.items():
        types, expected = _KINDS[name]
        if not isinstance(value, types):
            raise ConfigError(f"load_model: {name} must be {expected}, got {type(value).__name__} {value!r}")
        if name in ("path", "revision", "download_dir") and isinstance(value, (str, Path)) and not str(value).strip():
            raise ConfigError(f"load_model: {name} is empty ({value!r}); give one or leave it None")
    bad = [p for p in args["disable_passes"] if not isinstance(p, str)]
    if bad:
        raise ConfigError(f"load_model: disable_passes must hold pass names (strings), got {bad[0]!r}")
    tp = args["tensor_parallel"]
    if tp is not None and (
        len(tp) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in tp) or not 0 <= tp[0] < tp[1]
    ):
        raise ConfigError(f"load_model: tensor_parallel must be (rank, world) ints with 0 <= rank < world, got {tp!r}")


def _weight_format(model_dir: Path, spec, backend, quantization: str | None, tp) -> str | None:
    """The model's weight format, checked against the backend before any weight is read."""
    from dinfer_rt import quant
    from dinfer_rt.errors import BackendError

    gptq = quant.gptq_config(spec.config, model_dir / "config.json")
    if gptq is not None and quantization is not None:
        raise ConfigError(
            f"{model_dir}: the checkpoint is GPTQ-quantised already; quantization={quantization!r} does not apply"
        )
    if quantization is not None:
        quant.check_format(quantization)
        if tp is not None:
            raise ConfigError("quantization under tensor parallelism is not supported yet")
    fmt = "gptq4" if gptq is not None else quantization
    formats = backend.capabilities().weight_formats
    if fmt is not None and fmt not in formats:
        raise BackendError(
            f"backend {backend.describe()} has no {fmt} weight kernels; it supports: {', '.join(formats) or 'none'}"
        )
    return fmt
