"""``dinfer-rt`` command line: generate, serve, eval, bench, validate, kernels compile, ir, backends, env.

Errors on bad input print ``error: <message>`` and exit 2 without a traceback;
``--debug`` (before the command) re-raises to show it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
from dataclasses import asdict
from decimal import Decimal
from pathlib import Path

from dinfer_rt import envs
from dinfer_rt.engine_args import PREFIX_CACHE_MODES, EngineArgs
from dinfer_rt.errors import DinferError
from dinfer_rt.files import check_output_file
from dinfer_rt.sampling import CACHES, STRATEGIES, SamplingParams
from dinfer_rt.strategies import PRESETS, preset_fields, unread


def _int_in(low: int, high: int | None = None):
    """An argparse type: an int in [low, high], else an error naming the flag and the range."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low or (high is not None and v > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {span}, got {v}")
        return v

    return parse


# K, KiB .. T, TiB: powers of 1024; KB .. TB: powers of 1000 (matched in any case)
_BYTE_UNITS = {"": 1, "b": 1} | {
    f"{p}{suffix}": base**i for i, p in enumerate("kmgt", 1) for suffix, base in (("", 1024), ("ib", 1024), ("b", 1000))
}


def _byte_size(text: str) -> int:
    """An argparse type: bytes (``1073741824``) or a size with a unit (``8GiB``, ``512MiB``,
    ``1.5G``; KiB, MiB, GiB, TiB and K, M, G, T are powers of 1024, KB, MB, GB, TB of 1000; any
    case), at least one byte; else an error naming the value."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = _BYTE_UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise argparse.ArgumentTypeError(
            f"expected bytes or a size with a unit (e.g. 8GiB, 512MiB, 1073741824), got {text!r}"
        )
    v = int(Decimal(m.group(1)) * unit)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return v


def _fraction(text: str) -> float:
    """An argparse type: a number in (0, 1], else an error naming the value."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,  # a string until _resolve_model_args: an empty one is refused by name, not read as '.'
        help="model folder, or a hub id ORG/NAME (default: $DINFER_MODEL or the embedded model)",
    )
    _add_hub_args(p)
    p.add_argument("--backend", default=None, help="backend name[:flavour[:arch]] (default: $DINFER_BACKEND or auto)")
    p.add_argument("--dtype", default=None, help="auto (default: checkpoint dtype on a device, float32 on cpu), ...")
    p.add_argument(
        "--no-check-weights",
        action="store_true",
        help="skip the NaN/inf scan of the weights (trusted checkpoints)",
    )
    p.add_argument(
        "--quantization",
        choices=("int8", "fp8"),
        default=None,
        help="weight-only quantise the decoder projections at load (GPTQ checkpoints load as they are)",
    )


def _add_hub_args(p: argparse.ArgumentParser, template: bool = True) -> None:
    p.add_argument("--revision", default=None, help="hub ids: branch, tag or commit (default: main)")
    p.add_argument("--download-dir", default=None, help="hub ids: cache folder (default: the hub library's cache)")
    if template:
        p.add_argument(
            "--chat-template-name",
            default=None,
            help="tokenizer_config.json with several named chat templates: which one (default: 'default')",
        )


def _resolve_model_args(a: argparse.Namespace) -> None:
    """Turn ``--model`` (or ``$DINFER_MODEL``) into a local folder once, before any command runs:
    a hub id is downloaded or found in the hub cache here (``dinfer_rt.hub``), so every later
    step and every worker process sees a folder. ``a.hub_id`` keeps the id (the served name)."""
    a.hub_id = None
    if not hasattr(a, "model"):
        return
    from dinfer_rt.hub import is_hub_id
    from dinfer_rt.loader import model_folder

    given = str(a.model) if a.model is not None else envs.get(envs.DINFER_MODEL)
    revision, download_dir = getattr(a, "revision", None), getattr(a, "download_dir", None)
    if a.model is not None or revision is not None or download_dir is not None or given:
        folder = model_folder(a.model if a.model is not None else given, revision, download_dir)
        a.hub_id = given if given and is_hub_id(given) and folder != Path(given) else None
        a.model = folder
    name = getattr(a, "chat_template_name", None)
    if name is not None:  # a name the tokenizer config does not have fails now, before the weights load
        from dinfer_rt.loader import default_model_path
        from dinfer_rt.tokenizer import select_chat_template, tokenizer_config

        folder = a.model or default_model_path()
        select_chat_template(folder, tokenizer_config(folder), name)


def _choose_template(llm, a: argparse.Namespace):
    """``--chat-template-name`` for commands that build an ``LLM`` from a path."""
    name = getattr(a, "chat_template_name", None)
    if name is not None:  # prompts are rendered in this process, also for worker pools
        tok = llm.tokenizer if hasattr(llm, "tokenizer") else llm.model.tokenizer
        if tok is None:
            raise DinferError("--chat-template-name: this model was loaded without a tokenizer")
        tok.choose_chat_template(name)
    return llm


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=_int_in(1), default=1, help="shard the model over N worker processes")
    p.add_argument(
        "--data-parallel-size", type=_int_in(1), default=1, help="M replicas (own TP groups) split the prompts"
    )
    p.add_argument(
        "--expert-parallel",
        action="store_true",
        help="MoE layers: split whole experts over the ranks (E/N each) instead of each expert's intermediate size",
    )


def _torchrun_rank(a: argparse.Namespace) -> int | None:
    """Under ``torchrun`` (WORLD_SIZE set; env:// rendezvous, one or several machines) with
    ``--tensor-parallel-size`` > 1: check the sizes, join torchrun's process group and return this
    rank; None when this process should start its own ranks (or run alone)."""
    from dinfer_rt import parallel
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.model_spec import parse_spec

    world = getattr(a, "tensor_parallel_size", 1)
    if "WORLD_SIZE" not in os.environ or world == 1:
        return None
    parallel.check_split(parse_spec(a.model or default_model_path()), world, a.expert_parallel)
    if a.data_parallel_size > 1:
        raise DinferError("--data-parallel-size under torchrun: start one torchrun per replica instead")
    if int(os.environ["WORLD_SIZE"]) != world:
        raise DinferError(f"--tensor-parallel-size {world} but torchrun started {os.environ['WORLD_SIZE']} ranks")
    rank = int(os.environ["RANK"])
    parallel.init_group(a.backend, rank, world)
    return rank


def _llm(a: argparse.Namespace):
    """The LLM the model flags describe: in this process, on worker processes it starts (TP / DP >
    1), or this torchrun rank's shard (``a.rank`` is set to the rank, 0 otherwise)."""
    from dinfer_rt.llm import LLM

    tp, dp = getattr(a, "tensor_parallel_size", 1), getattr(a, "data_parallel_size", 1)
    if (tp > 1 or dp > 1) and a.quantization is not None:
        raise DinferError("--quantization with --tensor-parallel-size / --data-parallel-size is not supported yet")
    a.rank = _torchrun_rank(a)
    if a.rank is not None:
        from dinfer_rt.model_runner import on_rank
        from dinfer_rt.parallel import load_sharded

        model = load_sharded(a.model, a.rank, tp, a.backend, a.dtype, a.expert_parallel)
        runner = on_rank(model)
        if runner is None:  # a follower rank: it ran the lead's forwards until the lead's command ended
            raise SystemExit(0)
        llm = LLM(model, **_engine_args(a))
        llm.runner = runner  # the followers are released when the lead leaves the group (main's end)
        return llm
    a.rank = 0
    llm = LLM(
        a.model,
        backend=a.backend,
        dtype=a.dtype,
        check_weights=not a.no_check_weights,
        quantization=a.quantization,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        expert_parallel=getattr(a, "expert_parallel", False),
        **_engine_args(a),
    )
    return _choose_template(llm, a)


def _add_run_args(p: argparse.ArgumentParser, parallel: bool = True) -> None:
    """The flags of every command that decodes: the model, the request settings, the engine
    settings and (unless the command adds its own) the parallel sizes."""
    _add_model_args(p)
    _add_sampling_args(p)
    _add_engine_args(p)
    if parallel:
        _add_parallel_args(p)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """How the engine runs (``EngineArgs``): apart from what a request means."""
    d = EngineArgs()
    p.add_argument("--sync-every", type=int, default=d.sync_every, help="check block completion every k steps")
    p.add_argument(
        "--max-forward-tokens",
        type=int,
        default=d.max_forward_tokens,
        help="rows x computed positions per forward; a bigger batch runs in row slices",
    )
    p.add_argument(
        "--no-confidence-head",
        action="store_true",
        help="greedy score-only rules read full logits instead of the fused confidence head",
    )
    p.add_argument(
        "--max-prefill-chunk-tokens",
        type=int,
        default=d.max_prefill_chunk_tokens,
        help="block-causal models: the most prompt tokens one step prefills for a long prompt, in whole blocks "
        "(default: what --max-num-batched-tokens leaves beside the running rows; 0: off)",
    )
    p.add_argument(
        "--graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="device graphs for lockstep forwards (auto: the backend's default, DINFER_GRAPHS; on where the "
        "backend replays none is an error)",
    )
    p.add_argument(
        "--graph-batch-sizes",
        type=_int_list,
        default=None,
        metavar="N,N,...",
        help="batch-size buckets captured with --graphs (default 1,2,4 then every multiple of 8 up to max rows)",
    )
    p.add_argument(
        "--graph-length-step",
        type=_int_in(0),
        default=256,
        metavar="N",
        help="with --graphs, sequences pad to a multiple of N positions so prompts of many lengths share one "
        "capture (default 256; 0: a capture per length)",
    )


def _int_list(text: str) -> tuple[int, ...]:
    """``1,2,4`` -> (1, 2, 4); anything else an argparse error naming the value."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _engine_args(a: argparse.Namespace) -> dict:
    """The EngineArgs fields the engine flags set (validated where the engine is built)."""
    return {
        "sync_every": a.sync_every,
        "max_forward_tokens": a.max_forward_tokens,
        "confidence_head": not a.no_confidence_head,
        "graphs": {"auto": None, "on": True, "off": False}[a.graphs],
        "graph_batch_sizes": a.graph_batch_sizes,
        "graph_length_step": a.graph_length_step,
        "max_prefill_chunk_tokens": a.max_prefill_chunk_tokens,
    }


def _kv_budget_args(a: argparse.Namespace) -> dict:
    """``serve``'s KV pool flags as EngineArgs fields (absent: the engine's defaults)."""
    out = {} if a.kv_block_size is None else {"kv_block_size": a.kv_block_size}
    if a.kv_cache_memory is not None:
        out["kv_cache_memory"] = a.kv_cache_memory
    elif a.kv_cache_memory_fraction is not None:
        out["kv_cache_memory_fraction"] = a.kv_cache_memory_fraction
    return out


def _prefix_cache_args(a: argparse.Namespace) -> dict:
    """``serve``'s prefix cache flags as the EngineArgs fields (absent: the engine's defaults).
    ``--prefix-cache`` asked together with the cache turned off is a contradiction, named."""
    mode = getattr(a, "prefix_cache", None)
    if a.no_prefix_cache:
        if a.prefix_cache_bytes:
            raise DinferError("serve: --no-prefix-cache contradicts --prefix-cache-bytes > 0; give one of them")
        if mode is not None:
            raise DinferError(f"serve: --no-prefix-cache contradicts --prefix-cache {mode}; give one of them")
        return {"prefix_cache_bytes": 0}
    if mode == "approximate" and a.prefix_cache_bytes == 0:
        raise DinferError(
            "serve: --prefix-cache approximate contradicts --prefix-cache-bytes 0 (the cache off); give one of them"
        )
    if mode == "approximate" and getattr(a, "tensor_parallel_size", 1) > 1:
        raise DinferError(
            "serve: --prefix-cache approximate is not supported with --tensor-parallel-size > 1 (each rank holds a "
            "shard of the KV pool; only the exact cache of a block-causal model runs there); drop one of them"
        )
    out = {} if a.prefix_cache_bytes is None else {"prefix_cache_bytes": a.prefix_cache_bytes}
    return out if mode is None else {**out, "prefix_cache": mode}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    # strategy and the editing knobs default to None: a --preset fills what is not given explicitly
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default=None,
        help="named decoding settings (llada2.1-quality: joint_threshold 0.7 / edit 0.5 / 16 post steps; "
        "llada2.1-speed: 0.5 / 0.0 / 16); explicit flags override it",
    )
    p.add_argument("--strategy", choices=STRATEGIES, default=None, help=f"decision rule (default {d.strategy})")
    p.add_argument("--cache", choices=CACHES, default=None, help=f"K/V cache policy (default {d.cache})")
    p.add_argument(
        "--threshold", type=float, default=None, help=f"confidence threshold (threshold rules; default {d.threshold})"
    )
    p.add_argument(
        "--edit-threshold",
        type=float,
        default=None,
        help=f"joint_threshold: rewrite an unmasked token when another has probability above this (0: any "
        f"disagreeing token; default {d.edit_threshold})",
    )
    p.add_argument(
        "--max-post-steps",
        type=int,
        default=None,
        help=f"joint_threshold: editing forwards after a block's last mask (default {d.max_post_steps})",
    )
    p.add_argument(
        "--penalty-lambda",
        type=float,
        default=None,
        help="joint_threshold: subtract from the logit of the previous slot's token (0: off, the default)",
    )
    p.add_argument(
        "--low-threshold",
        type=float,
        default=None,
        help=f"hierarchical: per-run threshold (default {d.low_threshold})",
    )
    p.add_argument("--factor", type=float, default=None, help=f"factor rule's f (default {d.factor})")
    p.add_argument(
        "--refresh-bound",
        type=int,
        default=None,
        help="adaptive / anchored / delayed cache: refresh all K/V once a row committed this many tokens since the "
        "last refresh",
    )
    p.add_argument(
        "--refresh-window",
        type=int,
        default=None,
        help="adaptive / anchored / delayed cache: positions before the block recomputed each step (default: "
        "adaptive the whole prefix, anchored and delayed none besides the prompt)",
    )
    p.add_argument("--gen-length", type=int, default=d.gen_length)
    p.add_argument("--block-length", type=int, default=d.block_length)
    p.add_argument("--steps", type=int, default=None, help="step budget of scheduled rules (default: gen-length)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--cfg-scale", type=float, default=d.cfg_scale, help="classifier-free guidance (0: off)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-early-stop", action="store_true", help="decode every block even after EOS")
    p.add_argument("--raw", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable): a row ends once one is final")
    p.add_argument(
        "--precision-schedule",
        default=None,
        help="weight format per forward, e.g. int8@0.5,fp32 (int8 while > half the block is masked)",
    )
    p.add_argument(
        "--precision-refresh",
        action="store_true",
        help="recompute cached K/V at the first full-precision forward after low-precision ones",
    )


# SamplingParams fields whose CLI flag has the same name (``--gen-length`` -> gen_length)
_SAME_NAMED = (
    "gen_length block_length steps strategy threshold low_threshold factor temperature cfg_scale cache "
    "batch_size seed refresh_bound refresh_window precision_schedule precision_refresh "
    "edit_threshold max_post_steps penalty_lambda"
).split()


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _check_graph_flags(a: argparse.Namespace) -> None:
    """The graph knobs with ``--graphs off`` would be ignored: an error naming both, before the load."""
    if getattr(a, "graphs", None) != "off":
        return
    for flag, value, default in (
        ("--graph-batch-sizes", a.graph_batch_sizes, None),
        ("--graph-length-step", a.graph_length_step, 256),
    ):
        if value != default:
            raise DinferError(f"{flag} applies to device graphs (this run: --graphs off); drop one of the two")


def _check_parallel_flags(a: argparse.Namespace) -> None:
    """``--expert-parallel`` splits experts over tensor-parallel ranks: without
    ``--tensor-parallel-size`` > 1 it would be ignored (plain decoding), an error before the load."""
    if getattr(a, "expert_parallel", False) and getattr(a, "tensor_parallel_size", 1) == 1:
        raise DinferError(
            "--expert-parallel splits MoE experts over tensor-parallel ranks; it needs --tensor-parallel-size > 1"
        )


def _params(a: argparse.Namespace, request_settable=()) -> SamplingParams:
    """The request settings the sampling flags give (a ``--preset`` under them), validated (the
    graph and parallel flags too: ``_check_graph_flags``, ``_check_parallel_flags``); a
    rule-specific flag given explicitly that this run's strategy / cache / precision schedule
    does not read (``strategies.READ_BY``) is an error naming both, not silently ignored.
    ``request_settable``: the settings a request may change itself (``serve``: the flags are its
    defaults), whose conditions are not checked here."""
    _check_graph_flags(a)
    _check_parallel_flags(a)
    fields = {name: getattr(a, name) for name in _SAME_NAMED}
    given = [name for name, v in fields.items() if v is not None and v is not False]  # store_true: False unset
    from_preset = set()
    if getattr(a, "preset", None) is not None:  # the preset's values where no flag was given
        for name, value in preset_fields(a.preset).items():
            if fields.get(name) is None:
                fields[name] = value
                from_preset.add(name)
    fields = {name: v for name, v in fields.items() if v is not None}  # unset: SamplingParams' default
    params = SamplingParams(**fields, early_stop=not a.no_early_stop, chat=not a.raw, stop=tuple(a.stop))
    # block_causal=True: whether gen_length must be a multiple of block_length is the model's to say
    # (block-causal families align blocks to position 0); _check_for_model asks it before the load
    params.validate(block_causal=True)
    for name, setting, values in unread(params, given, request_settable):
        value = getattr(params, setting)
        source = (
            f", from --preset {a.preset}" if setting in from_preset else "" if setting in given else ", the default"
        )
        if values is None:
            needs, this_run, fix = f"runs with {_flag(setting)}", "none", f"add {_flag(setting)}"
        else:
            needs, this_run, fix = f"{_flag(setting)} {', '.join(values)}", value, f"add {_flag(setting)} {values[0]}"
        raise DinferError(
            f"{_flag(name)} applies to {needs} (this run: {this_run}{source}); {fix} or drop {_flag(name)}"
        )
    return params


def _sampling(a: argparse.Namespace) -> SamplingParams:
    """This run's request settings, checked once, before any model resolves or loads (``main``
    calls it first): ``serve``'s are the defaults of requests, which may set their own strategy,
    cache and rule-specific fields (``openai_protocol.DIFFUSION_FIELDS``)."""
    if getattr(a, "sampling", None) is None:
        settable = ()
        if a.command == "serve":
            from dinfer_rt.openai_protocol import DIFFUSION_FIELDS

            settable = DIFFUSION_FIELDS
        a.sampling = _params(a, settable)
    return a.sampling


def _check_for_model(a: argparse.Namespace) -> None:
    """The request settings against the model's config.json (read, nothing loaded), once
    ``--model`` names a folder: e.g. a gen_length that is no multiple of the block length, which
    only a block-causal family accepts. ``serve`` checks its defaults itself (``_check_serve_defaults``)."""
    if not hasattr(a, "gen_length") or a.command == "serve":
        return
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.model_spec import parse_spec

    _sampling(a).for_model(parse_spec(a.model or default_model_path()))


def cmd_generate(a: argparse.Namespace) -> int:

    if a.tensor_parallel_size > 1 or a.data_parallel_size > 1:
        return _generate_tensor_parallel(a)
    params = _sampling(a)  # checked before the model loads
    llm = _llm(a)  # one process: the model and engine flags as every command reads them
    outs = llm.generate(a.prompts, params, allow_mask_in_prompt=a.allow_mask_in_prompt)
    for o in outs:
        if a.json:
            print(json.dumps({"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids, **asdict(o.stats)}))
        else:
            s = o.stats
            print(o.text)
            print(
                f"  [{s.tokens} tokens, {s.nfe} forwards, {s.tokens_per_forward:.2f} tokens/forward, {s.wall_s:.2f} s]",
                file=sys.stderr,
            )
    return 0


def _generate_tensor_parallel(a: argparse.Namespace) -> int:
    """N worker processes, one shard each (gloo on the CPU, the backend's library on devices)."""
    from dinfer_rt import parallel
    from dinfer_rt.llm import generate_on_rank
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.model_spec import parse_spec

    world, params = a.tensor_parallel_size, _sampling(a)
    if a.quantization is not None:
        raise DinferError("--quantization with --tensor-parallel-size / --data-parallel-size is not supported yet")
    parallel.check_split(parse_spec(a.model or default_model_path()), world, a.expert_parallel)  # before spawning
    rank = _torchrun_rank(a)
    if rank is not None:  # started by torchrun
        outs = generate_on_rank(
            rank, world, a.model, a.prompts, params, a.backend, a.dtype, a.expert_parallel,
            allow_mask_in_prompt=a.allow_mask_in_prompt, **_engine_args(a),
        )  # fmt: skip
        if rank != 0:
            return 0
    else:  # worker processes this LLM starts (kept for its life: here, one call)
        llm = _llm(a)
        try:
            outs = llm.generate(a.prompts, params, allow_mask_in_prompt=a.allow_mask_in_prompt)
        finally:
            llm.close()
    for prompt, o in zip(a.prompts, outs):
        print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids}) if a.json else o.text)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from dinfer_rt.loader import load_model
    from dinfer_rt.server import ServeConfig, check_before_load, serve

    defaults = _sampling(a)
    config = ServeConfig(
        host=a.host,
        port=a.port,
        model_name=a.served_model_name or a.hub_id or (a.model.name if a.model else "dinfer-rt-embedded"),
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_queue=a.max_queue,
        max_model_len=a.max_model_len,
        drain_timeout=a.drain_timeout,
        body_timeout=a.body_timeout,
        shutdown_after_requests=a.shutdown_after_requests,
        shutdown_after_s=a.shutdown_after_s,
        max_request_bytes=a.max_request_bytes,
        engine_args={**_engine_args(a), **_prefix_cache_args(a), **_kv_budget_args(a)},
    )
    check_before_load(config, a.model, a.backend, a.dtype, a.data_parallel_size)  # before any allocation
    defaults = _check_serve_defaults(a.model, defaults, config)
    load = {"backend": a.backend, "dtype": a.dtype, "check_weights": not a.no_check_weights}
    if a.chat_template_name is not None:
        load["chat_template_name"] = a.chat_template_name
    load["quantization"] = a.quantization
    if a.data_parallel_size > 1 or a.tensor_parallel_size > 1 or a.engine_process:
        from dinfer_rt.server import engine_kwargs
        from dinfer_rt.workers import ReplicaPool

        kwargs = engine_kwargs(config, defaults)
        kwargs.pop("max_queue")
        pool = ReplicaPool(
            a.data_parallel_size, {"path": a.model, **load}, kwargs, max_queue=config.max_queue,
            tp_size=a.tensor_parallel_size, expert_parallel=a.expert_parallel,
            collective_timeout=a.distributed_timeout,
        )  # fmt: skip
        if a.chat_template_name is not None:  # the front end renders the chats: the same template as the replicas
            pool.tokenizer.choose_chat_template(a.chat_template_name)
        return serve(pool, defaults, config)
    return serve(load_model(a.model, **load), defaults, config)


def _check_serve_defaults(path, defaults: SamplingParams, config) -> SamplingParams:
    """The request settings a server applies by default, checked at start-up as the engine checks
    every request: a default it would refuse is one error now, not a 400 on every request.
    Returns them resolved for the model (``SamplingParams.for_model``: its block length)."""
    from dinfer_rt.engine import check_request
    from dinfer_rt.errors import GenerationError
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.model_spec import parse_spec

    spec = parse_spec(path or default_model_path())
    max_len = min(config.max_model_len or spec.max_length, spec.max_length)
    try:
        spec.check_cache_policy(defaults.cache)
        defaults = defaults.for_model(spec)
        check_request(
            [0], defaults, None, vocab=spec.vocab, max_model_len=max_len, has_tokenizer=True,
            block_causal=spec.block_causal,
        )  # fmt: skip
    except GenerationError as e:
        raise DinferError(f"serve: every request would be refused with these defaults: {e}") from None
    return defaults


_EVAL_DATA_FLAGS = {
    "prompt_field": "prompt",
    "answer_field": "answer",
    "metric": "exact",
    "regex": None,
    "output": None,
}


def _check_eval_flags(a: argparse.Namespace) -> None:
    """``eval``'s ``--data`` flags: one given without ``--data`` (the held-out set reads none of
    them), or ``--regex`` under another metric, is an error naming it; then the defaults."""
    for name in _EVAL_DATA_FLAGS:
        if a.data is None and getattr(a, name) is not None:
            raise DinferError(
                f"eval {_flag(name)} applies to eval --data FILE.jsonl (this run: the embedded model's held-out "
                f"set); add --data FILE.jsonl or drop {_flag(name)}"
            )
    if a.regex is not None and a.metric != "regex":
        this_run = "exact, the default" if a.metric is None else a.metric
        raise DinferError(
            f"eval --regex applies to --metric regex (this run: {this_run}); add --metric regex or drop --regex"
        )
    for name, default in _EVAL_DATA_FLAGS.items():
        if getattr(a, name) is None:
            setattr(a, name, default)


def cmd_eval(a: argparse.Namespace) -> int:

    if a.data is not None:
        from dinfer_rt.evaluation import read_items, scorer

        scorer(a.metric, a.regex)  # a bad metric, pattern or data file is refused before the model loads
        read_items(a.data, a.prompt_field, a.answer_field, a.limit)
        if a.output is not None:
            check_output_file(a.output, "--output")
    elif a.limit is not None and a.limit > 1000:
        raise DinferError(f"eval --limit {a.limit}: the held-out set has 1000 items")
    params = _sampling(a)  # checked before the model loads
    llm = _llm(a)
    if a.data is not None:
        return _eval_data(llm, a)
    from dinfer_rt.demo.bench import evaluate

    r = evaluate(llm, params, limit=a.limit or 1000, progress=not a.json and a.rank == 0)
    if a.rank != 0:  # a torchrun rank other than 0: the same result, reported once by rank 0
        return 0
    if a.json:
        print(json.dumps(r.as_dict()))
    else:
        print(
            f"accuracy {r.accuracy:.4f} ({r.n} items) | NFE {r.nfe} | TPF {r.tpf:.2f} | "
            f"{r.tokens_per_s:.1f} tokens/s | {r.wall_s:.1f} s"
        )
    return 0


def _eval_data(llm, a: argparse.Namespace) -> int:
    from dinfer_rt.evaluation import evaluate_file

    r = evaluate_file(
        llm,
        _sampling(a),
        a.data,
        prompt_field=a.prompt_field,
        answer_field=a.answer_field,
        metric=a.metric,
        pattern=a.regex,
        limit=a.limit,
        output=a.output if a.rank == 0 else None,
        progress=not a.json and a.rank == 0,
    )
    if a.rank != 0:
        return 0
    if a.json:
        print(json.dumps(r.as_dict()))
        return 0
    rows = [
        ("file", str(a.data)),
        ("metric", a.metric + (f" {a.regex!r}" if a.metric == "regex" else "")),
        ("items", str(r.n)),
        ("accuracy", f"{r.accuracy:.4f} ({r.correct}/{r.n})"),
        ("95% CI (Wilson)", f"[{r.ci_low:.4f}, {r.ci_high:.4f}]"),
        ("forwards", str(r.nfe)),
        ("tokens/s", f"{r.tokens_per_s:.1f}"),
        ("wall s", f"{r.wall_s:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if a.output is not None:
        print(f"per-item results: {a.output}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    """Per-step latency percentiles, tokens/s and peak memory for one configuration."""
    from dinfer_rt.validation.perf import measure

    params = _sampling(a)
    if a.tensor_parallel_size > 1:
        from dinfer_rt import parallel

        if a.data_parallel_size > 1 or a.quantization is not None:
            raise DinferError("bench --tensor-parallel-size: one TP group, unquantised (no --data-parallel-size)")
        source = (a.data, a.prompt_len)
        args = (a.model, a.batch_size, params, a.warmup, a.iters, a.backend, a.dtype, a.expert_parallel, source)
        rank = _torchrun_rank(a)
        if rank is None:
            result = parallel.launch(a.tensor_parallel_size, bench_on_rank, *args, backend=a.backend)
        else:  # this torchrun rank runs its share; rank 0 reports
            result = bench_on_rank(rank, a.tensor_parallel_size, *args)
            if rank != 0:
                return 0
    else:
        llm = _llm(a)
        prompts = bench_prompts(llm, a.batch_size, params, (a.data, a.prompt_len))
        result = measure(llm.model, prompts, params, a.warmup, a.iters)
    if a.json:
        print(json.dumps(result))
    else:
        print(" | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    return 0


def bench_prompts(llm, n: int, params, source: tuple) -> list[list[int]]:
    """The prompts ``bench`` measures: ``--data`` FILE's (its ``prompt`` field), ``--prompt-len``
    random in-vocabulary ids (seeded; never the mask token), or the embedded task's prompts,
    which only the embedded model reads as text."""
    import torch

    from dinfer_rt.demo import task
    from dinfer_rt.evaluation import encode_items, read_items
    from dinfer_rt.loader import default_model_path

    data, prompt_len = source
    if data is not None:
        ids = encode_items(llm, read_items(data, "prompt", "prompt", limit=n), data, params.chat)
        return [ids[i % len(ids)] for i in range(n)]
    if prompt_len is not None:
        g = torch.Generator().manual_seed(0)
        vocab, mask = llm.model.spec.vocab, llm.model.mask_id
        ids = torch.randint(0, vocab - 1, (n, prompt_len), generator=g)
        return (ids + (ids >= mask).long()).tolist()  # every id but the mask token
    if Path(llm.model.path).resolve() != Path(default_model_path()).resolve():
        raise DinferError(
            f"bench: the embedded task's prompts fit only the embedded model, not {llm.model.path}; "
            "give --data FILE.jsonl (a 'prompt' field per line) or --prompt-len N"
        )
    return [llm.encode(it.letters, params.chat) for it in task.heldout(n)]


def bench_on_rank(
    rank: int, world: int, path, n_prompts: int, params, warmup: int, iters: int, backend, dtype,
    expert_parallel=False, source: tuple = (None, None),
):  # fmt: skip
    """``dinfer-rt bench`` on rank ``rank``'s shard: rank 0 measures, driving the group's forwards
    (``model_runner``); the other ranks run them and return None."""
    from dinfer_rt.llm import LLM
    from dinfer_rt.model_runner import on_rank
    from dinfer_rt.parallel import load_sharded
    from dinfer_rt.validation.perf import measure

    model = load_sharded(path, rank, world, backend, dtype, expert_parallel)
    runner = on_rank(model)
    if runner is None:
        return None
    try:
        llm = LLM(model)
        return measure(model, bench_prompts(llm, n_prompts, params, source), params, warmup, iters, runner=runner)
    finally:
        runner.stop()


def _check_names(flag: str, text: str) -> None:
    """A comma-separated list flag (``validate --backends`` / ``--dtypes``): no name at all, or an
    empty item, is an error naming the flag (validating nothing would print a pass)."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise DinferError(
            f"validate {flag} {envs.shown(text)} names nothing; give comma-separated names"
            + (" or all (the available backends)" if flag == "--backends" else " (float32, bfloat16, ...)")
        )
    if "" in items:
        raise DinferError(f"validate {flag} {envs.shown(text)}: item {items.index('') + 1} is empty")
    if flag == "--backends" and "all" in items and len(items) > 1:
        raise DinferError(f"validate {flag} {envs.shown(text)}: 'all' (every available backend) stands alone")
    twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if twice is not None:  # it would be validated (and reported) twice
        raise DinferError(f"validate {flag} {envs.shown(text)} names {envs.shown(twice)} twice")


def cmd_validate(a: argparse.Namespace) -> int:
    from dinfer_rt.files import write_text_atomic
    from dinfer_rt.validation.markdown import render
    from dinfer_rt.validation.runner import validate

    for flag, text in (("--backends", a.backends), ("--dtypes", a.dtypes)):
        _check_names(flag, text)
    for flag, target in (("--json", a.json), ("--markdown", a.markdown)):  # unwritable: fails now, not after
        if target:
            check_output_file(target, f"{flag} report")
    if a.json and a.markdown and a.json != "-" and os.path.realpath(a.json) == os.path.realpath(a.markdown):
        raise DinferError(
            f"validate --json and --markdown name the same file ({a.json}): the second report would replace the first"
        )

    report = validate(a.backends, quick=a.quick, dtypes=a.dtypes)
    if a.json:
        write_text_atomic(a.json, json.dumps(report, indent=1, default=str) + "\n", "the JSON report")
    text = render(report)
    if a.markdown:
        write_text_atomic(a.markdown, text, "the Markdown report")
    for r in report["results"]:
        print(f"{r['backend']}: {r['verdict']}" + "".join(f"\n  - {f}" for f in r["failures"]))
    print(f"verdict: {report['verdict']}")
    return 0 if report["verdict"] == "pass" else 1


def cmd_kernels(a: argparse.Namespace) -> int:
    """Compile every kernel of a backend for one target ahead of time and report its resources
    (the targets are whatever the installed backends contribute through a hook)."""
    import os

    from dinfer_rt.errors import BackendError
    from dinfer_rt.plugins import compile_targets

    if os.environ.get("TRITON_INTERPRET") == "1" or envs.flag(envs.DINFER_INTERPRET):
        raise BackendError(
            "kernels compile needs real Triton JIT functions: unset TRITON_INTERPRET and DINFER_INTERPRET"
        )
    targets = compile_targets()
    if a.target not in targets:
        known = ", ".join(sorted(targets)) or "none (no installed backend contributes compile targets)"
        raise BackendError(f"unknown kernel target {a.target!r}; supported: {known}")
    rows = targets[a.target]()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    hip = any("sgpr_spills" in r for r in rows)
    regs = "VGPRs/SGPRs" if hip else "registers"
    print(f"{'kernel':24} {'target':16} {'warps':5} {regs:11} {'spills':10} {'LDS B' if hip else 'shared B'}")
    for r in rows:
        used = f"{r['registers']}/{r['sgprs']}" if hip else str(r["registers"])
        spills = f"{r['spill_stores']}v/{r['sgpr_spills']}s" if hip else f"{r['spill_stores']}/{r['spill_loads']} B"
        print(f"{r['kernel']:24} {r['target']:16} {r['num_warps']:<5} {used:11} {spills:10} {r['shared_bytes']}")
    return 0


def cmd_ir(a: argparse.Namespace) -> int:
    from dinfer_rt.dtypes import resolve_dtype
    from dinfer_rt.loader import default_model_path
    from dinfer_rt.lowering import lower
    from dinfer_rt.model_spec import parse_spec

    spec = parse_spec(a.model or default_model_path())
    bs = a.block_size or spec.default_block_size
    graph = lower(spec, resolve_dtype(a.dtype), cached=a.cached, block_size=bs)
    if a.backend is None:
        print(graph)
        return 0
    print(_annotated(graph, a.backend))
    return 0


def _annotated(graph, choice: str) -> str:
    """``graph`` with the kernel each node gets on backend ``choice`` (``name[:flavour[:arch]]``).
    Listing kernels needs no device, so an unavailable backend is annotated too, as long as its
    kernel table builds without its runtime (the Triton backends'); one whose kernels are its
    runtime's operators (ascend: torch_npu's) is refused with the reason it is unavailable."""
    from dinfer_rt.errors import BackendError
    from dinfer_rt.executor import Executable
    from dinfer_rt.plugins import availability, construct_backend, contributions

    backend = construct_backend(choice, "--backend")
    name = backend.name
    av = availability(backend)
    backend.contributions = contributions(backend)
    try:
        table = backend.kernel_table()
    except Exception as e:
        if av.ok:
            raise
        detail = "" if isinstance(e, DinferError) else f" ({type(e).__name__}: {e})"
        raise BackendError(
            f"ir --backend {choice}: backend {name!r} is unavailable: {av.reason}; its kernels cannot be listed "
            f"without it{detail}"
        ) from None
    return Executable.annotate(graph, {op: src for op, (_, src) in table.items()}, choice)


def cmd_backends(a: argparse.Namespace) -> int:
    from dinfer_rt.errors import BackendError
    from dinfer_rt.plugins import availability, instantiate, registry

    reg = registry()
    rows = []
    for name, cls in sorted(reg.backends.items()):
        av = availability(cls)
        try:
            b = instantiate(cls)
            versions, collectives = b.versions(), b.capabilities().collectives if av.ok else None
        except Exception as e:  # a plugin's fault is its row, not the end of the listing
            why = e if isinstance(e, BackendError) else f"plugin {reg.plugin_of[name]!r} fault: {type(e).__name__}: {e}"
            rows.append(
                {"name": name, "flavour": "-", "available": False, "reason": str(why), "device": "-",
                 "collectives": None, "plugin": reg.plugin_of[name], "versions": {}}
            )  # fmt: skip
            continue
        rows.append(
            {
                "name": name,
                "flavour": b.flavour,
                "available": av.ok,
                "reason": av.reason,
                "device": b.device_type,
                "collectives": collectives,
                "plugin": reg.plugin_of[name],
                "versions": versions,
            }
        )
    rows += [
        {
            "name": f.name,
            "flavour": "-",
            "available": False,
            "reason": f.reason if f.hook is None else f"plugin failed in {f.hook}: {f.reason}",
            "device": "-",
            "collectives": None,
            "plugin": f.name,
            "versions": {},
        }
        for f in reg.failures
    ]
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'name':12} {'flavour':20} {'available':9}  {'device':6}  reason")
    for r in rows:
        avail = "yes" if r["available"] else "no"
        print(f"{r['name']:12} {r['flavour']:20} {avail:9}  {r['device']:6}  {r['reason']}")
    return 0


def cmd_env(a: argparse.Namespace) -> int:
    import torch

    import dinfer_rt
    from dinfer_rt.plugins import describe_all, env_info

    info = env_info()  # first: a plugin failing here is then listed under backends
    print(f"dinfer-rt {dinfer_rt.__version__}")
    print(f"python {platform.python_version()} on {platform.platform()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("backends:")
    print(describe_all())
    if info:
        print("plugins:")
        for k, v in sorted(info.items()):
            print(f"  {k}: {v}")
    print("environment:")
    for k in envs.ALL:
        print(f"  {k}={os.environ.get(k) or ''}")  # as set, even a value other commands refuse
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dinfer-rt", description="Diffusion LM inference runtime")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.add_argument(
        "--allow-mask-in-prompt", action="store_true", help="let a prompt hold the mask token (infilling on purpose)"
    )
    _add_run_args(g)
    g.set_defaults(func=cmd_generate)
    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: localhost only)")
    sv.add_argument("--port", type=_int_in(0, 65535), default=8000)
    sv.add_argument("--served-model-name", default=None, help="the model id clients send (default: the folder name)")
    sv.add_argument("--max-num-seqs", type=_int_in(1), default=16, help="rows decoding at once")
    sv.add_argument(
        "--max-num-batched-tokens", type=_int_in(1), default=4096, help="query slots per forward at admission"
    )
    sv.add_argument("--max-queue", type=_int_in(0), default=256, help="waiting requests; past it: 429")
    sv.add_argument("--max-model-len", type=_int_in(1), default=None, help="prompt + generated tokens (KV-cache pool)")
    sv.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for running rows")
    sv.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds a request body may stall before a 408 (default 30)"
    )
    sv.add_argument("--shutdown-after-requests", type=_int_in(1), default=None, help="exit after N answers (tests)")
    sv.add_argument("--shutdown-after-s", type=float, default=None, help="exit after S seconds (tests)")
    sv.add_argument(
        "--max-request-bytes",
        type=_int_in(1),
        default=4 * 1024 * 1024,
        help="largest request body accepted (default 4 MiB); past it: 413",
    )
    sv.add_argument(
        "--data-parallel-size",
        type=_int_in(1),
        default=1,
        help="M engine replicas (processes; each --tensor-parallel-size ranks, one device per rank)",
    )
    sv.add_argument(
        "--tensor-parallel-size", type=_int_in(1), default=1, help="shard each replica over N rank processes"
    )
    sv.add_argument(
        "--expert-parallel", action="store_true", help="MoE layers: split whole experts over the ranks (E/N each)"
    )
    sv.add_argument(
        "--distributed-timeout",
        type=_int_in(1),
        default=600,
        metavar="SECONDS",
        help="a tensor-parallel collective waiting this long on a rank (died or hung) ends its replica: its "
        "requests fail naming it (default 600; a first forward of a new shape compiles on every rank within it)",
    )
    sv.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine in its own process, apart from the HTTP front (always so with replicas or ranks)",
    )
    sv.add_argument(
        "--prefix-cache-bytes",
        type=_int_in(0),
        default=None,
        help="block prefix cache budget across requests (default: the paged KV pool's bytes, whose blocks it "
        "shares; with --kv-block-size 0: 10%% of free CUDA/ROCm memory, else 1 GiB; 0: off)",
    )
    sv.add_argument("--no-prefix-cache", action="store_true", help="turn the block prefix cache off")
    sv.add_argument(
        "--prefix-cache",
        choices=PREFIX_CACHE_MODES,
        default=None,
        help="auto (default): exact reuse, block-causal models only; approximate: also bidirectional models "
        "(LLaDA, LLaDA-MoE, Dream; prefix/dual/vicinity requests), whose reused prompt K/V make outputs "
        "differ from a cold run (docs/serving.md)",
    )
    kv = sv.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-memory",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="KV-cache pool budget: bytes or a size with a unit (8GiB, 512MiB): SIZE // bytes per block KV blocks, "
        "taken per request (prompt + gen_length) at admission and shared with the prefix cache (default: at "
        "most half the free memory after the weights; with --kv-block-size 0, rows of --max-model-len)",
    )
    kv.add_argument(
        "--kv-cache-memory-fraction",
        type=_fraction,
        default=None,
        metavar="F",
        help="KV-cache pool budget as a fraction in (0, 1] of the free memory after the weights (CUDA / ROCm: "
        "the device's; CPU: MemAvailable)",
    )
    sv.add_argument(
        "--kv-block-size",
        type=_int_in(0),
        default=None,
        metavar="N",
        help="positions per KV block of the paged pool (default 4; at most --max-model-len + 1): a request takes "
        "the blocks of its own length, the prefix cache shares them; 0: contiguous rows of --max-model-len "
        "positions, preallocated for every --max-num-seqs row",
    )
    _add_run_args(sv, parallel=False)
    sv.set_defaults(func=cmd_serve)

    e = sub.add_parser("eval", help="accuracy and speed: the embedded model's held-out set, or --data FILE.jsonl")
    e.add_argument("--limit", type=_int_in(1), default=None, help="first N items (default: all; held-out set: 1000)")
    e.add_argument("--data", type=Path, default=None, help="a JSONL file of prompt/answer objects")
    # the --data flags default to None: one given without --data is refused (_check_eval_flags)
    e.add_argument("--prompt-field", default=None, help="--data: the prompt's field name (default prompt)")
    e.add_argument("--answer-field", default=None, help="--data: the reference answer's field name (default answer)")
    e.add_argument("--metric", default=None, help="--data: exact (default), contains or regex")
    e.add_argument("--regex", default=None, help="--data, metric regex: pattern whose group 1 is the answer")
    e.add_argument(
        "--output", type=Path, default=None, help="--data: write per-item results here (JSONL; - for standard output)"
    )
    e.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: accuracy, nfe, tpf, tokens_per_s, wall_s, n, forwards_by_precision",
    )
    _add_run_args(e)
    e.set_defaults(func=cmd_eval, batch_size=50)
    k = sub.add_parser("bench", help="per-step latency, tokens/s and peak memory of one configuration")
    k.add_argument("--warmup", type=_int_in(0), default=1)
    k.add_argument("--iters", type=_int_in(1), default=3)
    k.add_argument("--json", action="store_true")
    src = k.add_mutually_exclusive_group()
    src.add_argument("--data", type=Path, default=None, help="JSONL file whose 'prompt' fields are measured")
    src.add_argument("--prompt-len", type=_int_in(1), default=None, help="random prompts of N token ids")
    _add_run_args(k)
    k.set_defaults(func=cmd_bench, batch_size=8)
    val = sub.add_parser("validate", help="prove backends against the float64 reference; report and verdict")
    val.add_argument("--backends", default="all", help="comma-separated names, or 'all' available backends")
    val.add_argument("--quick", action="store_true", help="fewer shape buckets, models and items")
    val.add_argument("--dtypes", default="float32,bfloat16", help="dtypes for op conformance")
    val.add_argument("--json", default=None, help="write the JSON report here")
    val.add_argument("--markdown", default=None, help="write the Markdown report here")
    val.set_defaults(func=cmd_validate)
    kern = sub.add_parser("kernels", help="ahead-of-time kernel builds")
    ksub = kern.add_subparsers(dest="kernels_command", required=True)
    kc = ksub.add_parser(
        "compile",
        help="compile every kernel for a target a backend contributes, e.g. cuda:sm_90 (no device needed)",
    )
    kc.add_argument("--target", required=True, help="backend:arch, e.g. cuda:sm_90 or rocm_dcu:gfx942")
    kc.add_argument("--json", action="store_true")
    kc.set_defaults(func=cmd_kernels)
    i = sub.add_parser("ir", help="print the IR graph of a model (from its config.json)")
    i.add_argument("--model", default=None, help="model folder or hub id ORG/NAME")
    _add_hub_args(i, template=False)
    i.add_argument("--dtype", default=None)
    i.add_argument("--cached", action="store_true", help="the KV-cache variant of the graph")
    i.add_argument("--block-size", type=_int_in(1), default=None, help="block-causal block size (LLaDA2)")
    i.add_argument(
        "--backend",
        default=None,
        help="mark which kernel each node gets on this backend name[:flavour[:arch]] (also one unavailable here, "
        "where its kernels need no runtime: cuda, rocm_dcu)",
    )
    i.set_defaults(func=cmd_ir)
    b = sub.add_parser("backends", help="list backends and why each is or is not available")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_backends)
    v = sub.add_parser("env", help="versions, backends and DINFER_* variables for a bug report")
    v.set_defaults(func=cmd_env)
    return ap


# string flags that are paths: any bytes a file name may hold are fine there (surrogateescape round-trips)
_PATH_ARGS = ("model", "json", "markdown", "download_dir")


def _not_utf8(text: str) -> str | None:
    """Why an argument is not UTF-8, or None: Python decodes the command line with
    ``surrogateescape``, so a byte that is not UTF-8 arrives as a lone surrogate U+DC80..U+DCFF."""
    bad = [i for i, ch in enumerate(text) if "\udc80" <= ch <= "\udcff"]
    if not bad:
        return None
    try:
        raw = text.encode("utf-8", "surrogateescape")
        offset = len(text[: bad[0]].encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # also a real lone surrogate (an in-process argv): characters, not bytes
        raw, offset = None, bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    shown = envs.shown(text) if raw is None else repr(raw[:80]) + (f"... ({len(raw)} bytes)" if len(raw) > 80 else "")
    return f"{shown} has a byte that is not UTF-8 (0x{ord(text[bad[0]]) - 0xDC00:02x}) at position {offset}{more}"


_NOT_EMPTY = (
    ("model", "a model folder or a hub id ORG/NAME", f"${envs.DINFER_MODEL} or the embedded model"),
    ("backend", "a backend name[:flavour[:arch]] (dinfer-rt backends lists them)", f"${envs.DINFER_BACKEND} or auto"),
    ("download_dir", "a cache folder", "the hub library's cache"),
)


def _check_args(a: argparse.Namespace) -> None:
    """What the flags alone can refuse, before a hub id resolves (a download) or a model loads: text
    that is not UTF-8, an empty --model / --backend, the request settings, eval's --data flags."""
    for name, value in vars(a).items():
        if name in _PATH_ARGS:
            continue
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            why = _not_utf8(v) if isinstance(v, str) else None
            if why is not None:
                what = f"prompt {i + 1}" if name == "prompts" else _flag(name)
                raise DinferError(f"{what} {why}; arguments are read as UTF-8")
    for name, what, otherwise in _NOT_EMPTY:
        v = getattr(a, name, None)
        if isinstance(v, str) and not v.strip() and not os.path.exists(v):  # '' would read as '.' / as auto
            empty, flag = "is empty" if v == "" else "is only whitespace", _flag(name)
            raise DinferError(f"{flag} {v!r} {empty}; give {what}, or leave {flag} out for {otherwise}")
    if hasattr(a, "gen_length"):
        _sampling(a)
    if a.command == "eval":
        _check_eval_flags(a)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    finished = False
    try:
        _check_args(args)
        _resolve_model_args(args)
        _check_for_model(args)
        code = args.func(args)
        finished = True
        return code
    except DinferError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the conventional exit status, no traceback
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    finally:
        if "torch.distributed" in sys.modules:  # a command that may have joined a process group
            from dinfer_rt.parallel import leave_group

            leave_group(wait=finished)


if __name__ == "__main__":
    sys.exit(main())
