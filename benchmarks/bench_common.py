"""What the engine benchmarks share: their common command-line options and running the
measured work on a worker thread.

Import this before torch: it imports `ridgeline`, which makes idle OpenMP workers sleep
(see src/ridgeline/__init__.py), the same for Ridgeline and for its baselines."""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ridgeline  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)

T = TypeVar("T")


def engine_arg_parser(doc: str | None, *, kv_cache_mb: float,
                      quick_help: str = "a small smoke run") -> argparse.ArgumentParser:
    """--json, --quick, --model, --threads and --kv-cache-mb."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-mb", type=float, default=kv_cache_mb)
    return ap


def progress_log(json_only: bool) -> Callable[..., None]:
    """print, or print to stderr when stdout carries only the JSON object."""
    return (lambda *a: print(*a, file=sys.stderr, flush=True)) if json_only else print


def machine(threads: int) -> str:
    """The CPU's model name, its widest vector ISA and the thread count: numbers measured
    on an AVX-512 CPU and on an AVX2 one are not comparable (the C kernels differ)."""
    import platform

    from ridgeline.engine.cpu_kernels import cpu_flags

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.partition(":")[2].strip() for ln in f
                         if ln.startswith("model name")), name)
    except OSError:
        pass
    flags = cpu_flags()
    isa = next((i for i in ("avx512_bf16", "avx512f", "avx2") if i in flags), "no avx2")
    return f"{name} ({isa}), {threads} threads"


def on_worker_thread(fn: Callable[[], T], name: str) -> T:
    """fn() on a new thread, its exception re-raised here. On this machine torch's matmuls
    issued from the main thread have been measured several times slower than from another
    thread, and the server steps its engine on one."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001  (re-raised on the calling thread)
            box["error"] = e

    thread = threading.Thread(target=work, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def read_bandwidth_gbs() -> float:
    """Memory read bandwidth, GB/s: the median time to sum 1 GiB of float32 (far beyond
    any cache), on torch's threads."""
    import torch

    big = torch.ones(2 ** 28)
    t = median_seconds(lambda: big.sum(), reps=3)
    return round(big.numel() * 4 / t / 1e9, 2)


def median_seconds(fn: Callable[[], object], min_s: float = 0.15, reps: int = 5) -> float:
    """Median seconds per call of `fn` over `reps` rounds of at least `min_s` each
    (after one warm-up call)."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_s / 4 or n >= 1 << 14:
            break
        n *= 2
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n)
    return statistics.median(per)
