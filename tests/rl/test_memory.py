"""Issue 27: the trainer's autocast dtype follows the CPU (auto: bfloat16 only where bf16
is native), and every train step records the process's resident memory after handing
freed heap memory back to the OS."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.helpers.engine_fixtures import tiny_model

from ridgeline import cpu
from ridgeline.rl import memory, trainer as trainer_mod
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig, resolve_dtype

ZEN3 = cpu.CpuInfo("AMD EPYC 7763", "AuthenticAMD family 25 model 1 stepping 1",
                   frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"}))
SAPPHIRE_RAPIDS = cpu.CpuInfo("Intel Xeon Platinum 8480+", "GenuineIntel family 6 model 143",
                              frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16",
                                         "amx_tile"}))
GRAVITON3 = cpu.CpuInfo("", None, frozenset({"asimd", "sve", "bf16", "i8mm"}))


def _cpu(monkeypatch: pytest.MonkeyPatch, info: cpu.CpuInfo) -> None:
    """The CPU reports `info`, and the trainer reads it (conftest.py pins "auto" to
    float32 for the other tests)."""
    monkeypatch.setattr(cpu, "cpu_info", lambda: info)
    monkeypatch.setattr(trainer_mod, "has_native_bf16", cpu.has_native_bf16)


def _batch(lengths: tuple[int, ...] = (9, 14, 6), seed: int = 0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    eps = []
    for n in lengths:
        ids = torch.randint(1, 500, (n,), generator=g).tolist()
        ep = TokenEpisode.start(ids[: n // 2])
        k = n - n // 2
        ep.add_completion(ids[n // 2:], [-1.0] * k, [0] * k)
        eps.append(ep)
    return TokenBatch.of(eps, [1.0, -1.0, 0.5][: len(lengths)])


def test_native_bf16_is_read_from_the_cpu_flags():
    assert not cpu.has_native_bf16(ZEN3)
    assert cpu.has_native_bf16(SAPPHIRE_RAPIDS)
    assert cpu.has_native_bf16(GRAVITON3)
    assert cpu.has_native_bf16(cpu.CpuInfo("x", None, frozenset({"avx512_bf16"})))


@pytest.mark.parametrize(("info", "resolved"), [(ZEN3, "float32"),
                                                 (SAPPHIRE_RAPIDS, "bfloat16")])
def test_auto_dtype_resolves_by_the_cpu_once_at_construction(monkeypatch, info, resolved):
    _cpu(monkeypatch, info)
    assert TrainerConfig().dtype == "auto"
    assert resolve_dtype("auto") == resolved
    t = PolicyTrainer(tiny_model("llama", seed=1))
    assert t.autocast_dtype == resolved
    metrics = t.step(_batch())
    assert metrics["autocast_bf16"] == float(resolved == "bfloat16")
    # resolved once: a later change of what the CPU reports changes nothing
    _cpu(monkeypatch, SAPPHIRE_RAPIDS if resolved == "float32" else ZEN3)
    assert t.autocast_dtype == resolved


def test_explicit_dtypes_are_kept_and_emulated_bf16_warns(monkeypatch, caplog):
    _cpu(monkeypatch, ZEN3)
    model = tiny_model("llama", seed=1)
    with caplog.at_level(logging.WARNING, logger=trainer_mod.__name__):
        t = PolicyTrainer(model, TrainerConfig(dtype="bfloat16"))
    assert t.autocast_dtype == "bfloat16"          # it works, slowly: not an error
    assert any("without native bf16" in r.getMessage() for r in caplog.records)
    caplog.clear()
    _cpu(monkeypatch, SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.WARNING, logger=trainer_mod.__name__):
        assert PolicyTrainer(model, TrainerConfig(dtype="bfloat16")).autocast_dtype == \
            "bfloat16"
        assert PolicyTrainer(model, TrainerConfig(dtype="float32")).autocast_dtype == \
            "float32"
    assert not caplog.records


def test_every_step_records_resident_memory_and_releases_freed_memory(monkeypatch):
    released = []
    monkeypatch.setattr(trainer_mod, "release_freed_memory", lambda: released.append(1))
    t = PolicyTrainer(tiny_model("llama", seed=2), TrainerConfig(dtype="float32"))
    for i, lengths in enumerate([(9, 14, 6), (30, 5, 12), (7, 7, 7)]):
        m = t.step(_batch(lengths, seed=i))
        assert m["memory/rss_gb"] > 0
        assert m["memory/peak_rss_gb"] >= m["memory/rss_gb"] * 0.99
    assert len(released) == 3
    t = PolicyTrainer(tiny_model("llama", seed=2),
                      TrainerConfig(dtype="float32", release_memory=False))
    t.step(_batch())
    assert len(released) == 3


def test_memory_readings_and_malloc_trim_are_safe():
    rss, peak = memory.rss_gb(), memory.peak_rss_gb()
    assert rss is not None and peak is not None and 0 < rss <= peak * 1.01
    big = torch.ones(2 ** 25)  # 128 MB, freed below
    assert memory.rss_gb() > rss + 0.05
    del big
    assert isinstance(memory.release_freed_memory(), bool)
    assert memory.release_freed_memory() in (True, False)  # twice: nothing left, no error
    assert set(memory.memory_metrics()) == {"memory/rss_gb", "memory/peak_rss_gb"}


def test_release_is_a_no_op_without_glibc(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.release_freed_memory() is False


def test_the_progress_line_shows_resident_memory():
    from ridgeline.rl.run_log import format_progress

    line = format_progress(3, 10, {"step_seconds": 12.0, "memory/rss_gb": 3.14})
    assert "rss 3.1G" in line
    assert "rss" not in format_progress(3, 10, {"step_seconds": 12.0})


def test_large_allocations_can_be_mapped_on_linux_and_is_a_no_op_elsewhere(monkeypatch):
    import sys

    from ridgeline.rl import memory

    if sys.platform.startswith("linux"):
        assert memory.map_large_allocations() is True
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert memory.map_large_allocations() is False
