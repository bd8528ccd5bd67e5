"""Backends with one subtly wrong kernel each: the validation suite must catch and name them."""

import torch

from dinfer_rt.backends.cpu.backend import CpuBackend
from dinfer_rt.ir import ops
from dinfer_rt.plugins import hookimpl

DINFER_RT_HOOK_API = 2


def rms_norm_eps_off(x, weight, *, eps):
    return ops.rms_norm(x, weight, eps=eps + 1e-3)


def rope_wrong_way(x, positions, *, theta, rotary_dim):
    return ops.rope(x, -positions, theta=theta, rotary_dim=rotary_dim)  # rotates by -angle


def attention_ignores_padding(q, k, v, key_valid, token_index, k_cache=None, v_cache=None, *, scale, block_size=None):
    return ops.attention(
        q, k, v, torch.ones_like(key_valid), token_index, k_cache, v_cache, scale=scale, block_size=block_size
    )


FUSED_OPS = {"add_rms_norm", "swiglu", "lm_head_confidence", "rope_attention", "moe_routed"}


def _faulty(name, op, kernel):
    class Faulty(CpuBackend):
        flavour = "faulty"
        priority = -5

        def kernels(self):
            # A port without fused kernels: no fusion applies, so the faulty unfused kernel runs in the model.
            unfused = {k: v for k, v in super().kernels().items() if k not in FUSED_OPS}
            return {**unfused, op: kernel}

    Faulty.name = name
    return Faulty


FAULTS = {
    "faulty_norm": ("rms_norm", rms_norm_eps_off),
    "faulty_rope": ("rope", rope_wrong_way),
    "faulty_attention": ("attention", attention_ignores_padding),
}


@hookimpl
def dinfer_rt_register_backends():
    return [_faulty(name, op, k) for name, (op, k) in FAULTS.items()]
