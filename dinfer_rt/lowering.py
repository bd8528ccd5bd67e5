"""Lower a :class:`ModelSpec` to an IR graph: one generic decoder stack for all families.

Graph inputs:
  ``input_ids`` i64[B, T]   tokens computed by this forward
  ``positions`` i64[B, T]   RoPE positions of those tokens
  ``token_index`` i64[T]    sequence slot of each token (cache index, block-causal rule);
                            i64[B, T] with ``per_row`` (each row its own slots: continuous batching)
  ``key_valid`` bool[B, S]  padding mask over keys (S == T without a cache)
  ``k_cache.i``/``v_cache.i`` [B, S, KV, D] per layer, in the cached variant only; with
                            ``paged`` the layer's pools [NB, P, KV, D] instead, plus
  ``block_table`` i32[B, NBT]  the pool block holding each row's P-position span (``kv_gather``)
Outputs: ``logits`` [B, T, V] (unshifted), and the updated caches (or pools) in the cached variant.

A paged layer gathers its rows' S positions into contiguous scratch, runs the same ``attention``
over it, and scatters the slots it computed back into the pools (``kv_scatter``): the kernels
stay unchanged while the engine shares pool blocks between rows and its prefix cache.
"""

from __future__ import annotations

import math

import torch

from dinfer_rt import quant
from dinfer_rt.dtypes import accumulate_dtype
from dinfer_rt.ir import Graph, TensorType, Value
from dinfer_rt.model_spec import ModelSpec, param_plan


def lower(
    spec: ModelSpec,
    dtype: torch.dtype,
    *,
    cached: bool = False,
    block_size: int | None = None,
    head: str = "logits",
    mask_id: int | None = None,
    score: str = "max",
    per_row: bool = False,
    weight_format: str | None = None,
    paged: bool = False,
) -> Graph:
    """Build and verify the forward graph of ``spec`` in compute dtype ``dtype``.

    ``head="confidence"`` adds an input ``select`` i64[M] (indices into the T computed tokens;
    the last layer after its attention runs on those rows only) and outputs ``confidence`` /
    ``token`` [B, M] (the ``score`` kind: max probability, margin or negative entropy; and the
    argmax, ``mask_id`` banned) instead of ``logits``: the scheduler's greedy rules need nothing
    else. ``per_row`` makes ``token_index`` [B, T]: every row computes
    its own set of slots (rows at different blocks share one forward). ``weight_format``
    ("int8", "fp8", "gptq4") makes the decoder projections weight-only quantised linears over
    the parameters ``quant.quantized_names`` (or ``<name>@gptq4.<tensor>``) name (``dinfer_rt.quant``).
    ``paged`` (cached only) takes the KV as paged pools plus a ``block_table`` (module docstring).
    """
    if paged and not cached:
        raise ValueError("lower: paged=True needs cached=True (the pools are a KV cache)")
    acc = accumulate_dtype(dtype)
    g = Graph(f"{spec.family}{'_cached' if cached else ''}{'_paged' if paged else ''}{'_per_row' if per_row else ''}")
    ids = g.input("input_ids", TensorType(("B", "T"), torch.int64))
    pos = g.input("positions", TensorType(("B", "T"), torch.int64))
    tok = g.input("token_index", TensorType(("B", "T") if per_row else ("T",), torch.int64))
    key_valid = g.input("key_valid", TensorType(("B", "S" if cached else "T"), torch.bool))
    kvd = (spec.n_kv_heads, spec.head_dim)
    caches = []
    if cached:
        layout = ("NB", "P", *kvd) if paged else ("B", "S", *kvd)
        for i in range(spec.n_layers):
            caches.append(
                (
                    g.input(f"k_cache.{i}", TensorType(layout, dtype)),
                    g.input(f"v_cache.{i}", TensorType(layout, dtype)),
                )
            )
    table = g.input("block_table", TensorType(("B", "NBT"), torch.int32)) if paged else None
    P: dict[str, Value] = {}
    Q: dict[str, tuple[Value, ...]] = {}  # quantised projections: IR name -> the op's weight inputs
    for p in param_plan(spec):
        if weight_format is not None and quant.is_quantizable(p.name):
            Q[p.name] = _quantized_params(g, spec, p.name, p.shape, weight_format, dtype)
        else:
            P[p.name] = g.param(p.name, TensorType(p.shape, acc if p.keep_fp32 else dtype))
    zero_offset = quant.gptq_config(spec.config, "config.json")["zero_offset"] if weight_format == "gptq4" else 0

    def proj(x: Value, name: str, *tail: Value | None) -> Value:
        """The projection ``name`` of x (``tail``: its bias input, possibly None, when it has a slot)."""
        if name not in Q:
            return g.op("linear", x, P[name], *tail)
        if weight_format == "gptq4":
            return g.op("linear_gptq", x, *Q[name], *tail, zero_offset=zero_offset)
        return g.op("linear_wq", x, *Q[name], *tail)

    if spec.tie_embeddings:
        P["lm_head"] = P["embed"]

    h = g.op("embedding", ids, P["embed"])
    scale = 1.0 / math.sqrt(spec.head_dim)
    select = None
    for i in range(spec.n_layers):
        L = f"layers.{i}."
        n = g.op("rms_norm", h, P[L + "attn_norm"], eps=spec.eps)
        if spec.fused_qkv:
            d, kv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
            q, k, v = g.op("split", proj(n, L + "qkv"), sizes=(d, kv, kv))
        else:
            q, k, v = (proj(n, L + w, P.get(L + w + "_bias")) for w in "qkv")
        q = g.op("view_heads", q, heads=spec.n_heads)
        k = g.op("view_heads", k, heads=spec.n_kv_heads)
        v = g.op("view_heads", v, heads=spec.n_kv_heads)
        if spec.qk_norm:
            q = g.op("rms_norm", q, P[L + "q_norm"], eps=spec.eps)
            k = g.op("rms_norm", k, P[L + "k_norm"], eps=spec.eps)
        q = g.op("rope", q, pos, theta=spec.rope_theta, rotary_dim=spec.rotary_dim)
        k = g.op("rope", k, pos, theta=spec.rope_theta, rotary_dim=spec.rotary_dim)
        bs = block_size if spec.block_causal else None
        if paged:
            kc, vc = g.op("kv_gather", *caches[i], table, key_valid)
            a, kc, vc = g.op("attention", q, k, v, key_valid, tok, kc, vc, scale=scale, block_size=bs)
            kp, vp = g.op("kv_scatter", *caches[i], table, tok, kc, vc)
            g.output(f"k_cache.{i}", kp)
            g.output(f"v_cache.{i}", vp)
        elif cached:
            a, kc, vc = g.op("attention", q, k, v, key_valid, tok, *caches[i], scale=scale, block_size=bs)
            g.output(f"k_cache.{i}", kc)
            g.output(f"v_cache.{i}", vc)
        else:
            a = g.op("attention", q, k, v, key_valid, tok, scale=scale, block_size=bs)
        merged = g.op("merge_heads", a)
        if head == "confidence" and i == spec.n_layers - 1:
            # only the selected tokens' outputs are read: the rest of the last layer (O, the MLP or
            # experts, the final norm, the head) is row-wise, so it runs on those rows alone
            select = g.input("select", TensorType(("M",), torch.int64))
            merged, h = g.op("index_tokens", merged, select), g.op("index_tokens", h, select)
        h = g.op("add", h, proj(merged, L + "o"))
        m = g.op("rms_norm", h, P[L + "mlp_norm"], eps=spec.eps)
        if spec.is_moe_layer(i):
            y = _moe(g, spec, P, L, m, acc, proj)
        else:
            y = _swiglu(g, m, proj, L + "gate", L + "up", L + "down")
        h = g.op("add", h, y)
    h = g.op("rms_norm", h, P["final_norm"], eps=spec.eps)
    if head == "confidence":
        conf, token = g.op("confidence", g.op("linear", h, P["lm_head"]), banned=mask_id, kind=score)
        g.output("confidence", conf)
        g.output("token", token)
    else:
        g.output("logits", g.op("linear", h, P["lm_head"]))
    return g.verify()


def _quantized_params(g: Graph, spec: ModelSpec, name: str, shape, fmt: str, dtype: torch.dtype) -> tuple[Value, ...]:
    out_f, in_f = shape
    if fmt == "gptq4":
        cfg = quant.gptq_config(spec.config, "config.json")
        shapes = quant.gptq_shapes(out_f, in_f, cfg["group_size"], name)
        types = {"qweight": torch.int32, "qzeros": torch.int32, "scales": dtype, "g_idx": torch.int32}
        return tuple(g.param(f"{name}@gptq4.{s}", TensorType(shapes[s], types[s])) for s in quant.GPTQ_SUFFIXES)
    qname, sname = quant.quantized_names(name, fmt)
    return (
        g.param(qname, TensorType(tuple(shape), quant.QUANT_DTYPE[fmt])),
        g.param(sname, TensorType((out_f,), torch.float32)),
    )


def _swiglu(g: Graph, x: Value, proj, gate: str, up: str, down: str) -> Value:
    return proj(g.op("mul", g.op("silu", proj(x, gate)), proj(x, up)), down)


def _moe(g: Graph, spec: ModelSpec, P: dict[str, Value], L: str, m: Value, acc: torch.dtype, proj) -> Value:
    moe = spec.moe
    assert moe is not None
    logits = g.op("linear", g.op("cast", m, dtype=acc), P[L + "router"])
    if moe.router == "softmax":
        w, idx = g.op("router_softmax_topk", logits, k=moe.top_k, renormalize=moe.renormalize)
    else:
        w, idx = g.op(
            "router_sigmoid_grouped",
            logits,
            P[L + "expert_bias"],
            k=moe.top_k,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            renormalize=moe.renormalize,
            scale=moe.routed_scale,
        )
    y = g.op("moe_experts", m, w, idx, P[L + "experts_gate_up"], P[L + "experts_down"])
    if moe.n_shared:
        y = g.op("add", y, _swiglu(g, m, proj, L + "shared_gate", L + "shared_up", L + "shared_down"))
    return y
