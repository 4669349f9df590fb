"""The KV pool's memory: lazily resident, made resident in the background on request
(`kv_cache_prefault`), without touching what is already written."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from ridgeline.engine import LLM
from ridgeline.engine.model_executor.kv_cache import KVCache
from ridgeline.engine.model_executor.kv_quant import make_kv_cache
from tests.helpers.engine_fixtures import cached_model

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) is Linux")
PAGE = 4096


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the pages under `t` that are resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = t.numel() * t.element_size()
    pages = -(-size // PAGE)
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(t.data_ptr() // PAGE * PAGE, size, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def make(prefault: bool, kind: str = "auto") -> KVCache:
    # 2 layers x 2 (K, V) x 512 blocks x 16 x 2 heads x 64 float32: 16 MB
    return make_kv_cache(kind, num_layers=2, num_blocks=512, block_size=16, num_kv_heads=2,
                         head_dim=64, model_dtype=torch.float32, prefault=prefault)


@linux
def test_a_pool_is_not_resident_until_written() -> None:
    cache = make(prefault=False)
    assert cache._prefaulter is None
    assert resident_fraction(cache.k[0]) < 0.05


@linux
@pytest.mark.parametrize("kind", ["auto", "bfloat16", "int8"])
def test_prefault_makes_every_buffer_resident(kind: str) -> None:
    cache = make(prefault=True, kind=kind)
    pf = cache._prefaulter
    assert pf is not None and pf.wait(timeout=30)
    if pf.seconds is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    tensors = cache.k + cache.v + getattr(cache, "k_scale", []) + getattr(cache, "v_scale", [])
    assert all(resident_fraction(t) == 1.0 for t in tensors)
    assert all(not t.any() for t in tensors)  # still zeros


@linux
def test_prefault_keeps_what_the_engine_already_wrote() -> None:
    k = torch.randn(64, 2, 64)
    slots = torch.arange(0, 64 * 97, 97)  # scattered over the pool
    cache = make(prefault=True)
    cache.write(1, k, -k, slots)  # while its thread runs
    assert cache._prefaulter is not None and cache._prefaulter.wait(timeout=30)
    got_k, got_v = cache.gather(1, torch.arange(cache.num_blocks))
    assert torch.equal(got_k[slots], k) and torch.equal(got_v[slots], -k)


def test_release_stops_the_prefault_thread() -> None:
    cache = make(prefault=True)
    pf = cache._prefaulter
    assert pf is not None
    cache.release()
    assert cache._prefaulter is None and pf.wait(timeout=0)
    assert not cache.allocated


def test_the_engine_prefaults_by_default_and_sleep_stops_it() -> None:
    model = cached_model("llama")
    engine = LLM.from_hf_model(model, num_kv_blocks=64).engine
    pf = engine.runner.kv_cache._prefaulter
    assert pf is not None
    engine.sleep()
    assert pf.wait(timeout=0) and engine.runner.kv_cache._prefaulter is None
    engine.wake()
    assert engine.runner.kv_cache._prefaulter is not None
    off = LLM.from_hf_model(model, num_kv_blocks=64, kv_cache_prefault=False).engine
    assert off.runner.kv_cache._prefaulter is None


@pytest.mark.parametrize("kind", ["auto", "bfloat16"])
@pytest.mark.parametrize("rows", [3, 100])
def test_writes_of_fused_qkv_rows_land_in_their_slots(kind, rows, monkeypatch) -> None:
    from ridgeline.engine.kernels import decode_ops

    calls = []
    real = decode_ops.scatter_rows
    monkeypatch.setattr(decode_ops, "scatter_rows", lambda *a: calls.append(real(*a)) or calls[-1])
    cache = make(prefault=False, kind=kind)
    qkv = torch.randn(rows, 8 * 64)  # q (4 heads), k, v (2 heads each), as the model has it
    k, v = qkv[:, 256:384].view(rows, 2, 64), qkv[:, 384:].view(rows, 2, 64)
    slots = torch.randperm(cache.num_blocks * cache.block_size)[:rows]
    cache.write(0, k, v, slots)
    got_k, got_v = cache.gather(0, torch.arange(cache.num_blocks))
    store = cache.dtype if kind == "auto" else torch.bfloat16
    assert torch.equal(got_k[slots], k.to(store).to(got_k.dtype))
    assert torch.equal(got_v[slots], v.to(store).to(got_v.dtype))
    # the C copy for many rows of the cache's own dtype; index_copy_ for the rest
    assert any(calls) == (rows >= decode_ops.SCATTER_MIN_ROWS and kind == "auto")
