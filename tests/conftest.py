import os

# No GPU in the test environment: Triton kernels run in its interpreter, which must be chosen
# before triton is first imported (see dinfer_rt.envs).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from dinfer_rt.testing import checkpoints


@pytest.fixture(autouse=True)
def _isolate_backend_env(monkeypatch):
    """Each test starts with no backend chosen and a fresh plugin registry."""
    from dinfer_rt.plugins import registry

    for var in ("DINFER_BACKEND", "DINFER_PLUGINS", "DINFER_DISABLE_PLUGIN_AUTOLOAD", "DINFER_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    registry.cache_clear()
    torch.manual_seed(0)
    yield
    registry.cache_clear()
    os.environ.pop("DINFER_BACKEND", None)  # select_backend writes its resolved choice back


def _vector_builds() -> list[tuple[str, ...]]:
    """The CPU native library's builds this CPU runs whose register tiles differ: -march=native,
    then each narrower vector width it can fall back to (AVX2 without AVX-512, SSE without AVX),
    so every width's tiles are checked on every x86 machine CI lands on."""
    from dinfer_rt.backends.cpu import native

    flags = native._cpu_flags().split()
    return [()] + [(f"-mno-{isa}",) for isa in ("avx512f", "avx") if isa in flags]


@pytest.fixture(scope="module", params=_vector_builds(), ids=lambda flags: " ".join(flags) or "march-native")
def native_build(request):
    """The native library built for one vector width (``native.Native``); a failed build fails."""
    from dinfer_rt.backends.cpu import native

    built = native.build(request.param) if request.param else native.load()
    assert built.lib is not None, built.reason  # CI has a C compiler: a missing build is a failure
    return built


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Build each tiny checkpoint once per session: ckpt_dir(name) -> folder."""
    built: dict[str, object] = {}
    makers = {
        "llada": lambda p: checkpoints.llada(p),
        "llada_gqa_sharded": lambda p: checkpoints.llada(p, d=60, heads=6, kv_heads=2, shards=3, seed=7),
        "dream": lambda p: checkpoints.dream(p),
        "dream_sharded_tied": lambda p: checkpoints.dream(p, d=64, heads=4, kv_heads=4, shards=2, tie=True, seed=8),
        "llada_moe": lambda p: checkpoints.llada_moe(p),
        "llada_moe_sharded": lambda p: checkpoints.llada_moe(
            p, d=40, heads=5, head_dim=8, experts=5, top_k=3, layers=3, shards=2, seed=10
        ),
        "llada2": lambda p: checkpoints.llada2(p),
        "sdar": lambda p: checkpoints.sdar(p),
        "llada2_sharded": lambda p: checkpoints.llada2(
            p, heads=8, kv_heads=1, head_dim=12, shards=2, partial=1.0, seed=9
        ),
    }

    def get(name: str):
        if name not in built:
            built[name] = makers[name](tmp_path_factory.mktemp(name))
        return built[name]

    return get
