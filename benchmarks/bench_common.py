"""What the benchmarks share: the machine record every JSON result carries under
"machine" (`machine()`), the engine benchmarks' common command-line options and running
the measured work on a worker thread.

Import this before torch: it imports `ridgeline`, which makes idle OpenMP workers sleep
(see src/ridgeline/__init__.py), the same for Ridgeline and for its baselines."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

if "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    # torch's OpenMP runtime read its wait policy when torch loaded: spinning idle workers
    # stall short forward passes (speculative decoding's most of all), so the figures would
    # not compare with any recorded run
    raise RuntimeError("import bench_common before torch (it sets OMP_WAIT_POLICY=PASSIVE "
                       "for the benchmark; torch reads it once, when it loads)")

import ridgeline  # noqa: E402,F401  (sets OMP_WAIT_POLICY before torch loads)
from ridgeline.cpu import cpu_info

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


def _torch_version() -> str | None:
    """torch's version: from the module if loaded, else from its metadata (no import)."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(threads: int | None = None, **extra: Any) -> dict[str, Any]:
    """The machine a result was measured on, for every benchmark's JSON under "machine".

    A result is comparable only to a baseline from the same machine: the CPUs differ by
    generation (AVX2 only, or AVX-512 with BF16 and VNNI), and the C kernels with them.
    `cpu_flags` lists the vector/matrix flags present (`ridgeline.cpu`); `summary` is
    one line (model, widest ISA, threads); `extra` adds a script's own fields."""
    name, cpu_id, flags = cpu_info()  # ridgeline.cpu: the kernels' own reading
    isa = next((i for i in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if i in flags),
               "no avx2")
    info: dict[str, Any] = {
        "cpu_model": name,
        "cpu_id": cpu_id,
        "cpu_flags": cpu_info().simd_flags,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": _torch_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    if threads is not None:
        info["threads"] = threads
    info["summary"] = f"{name} ({isa})" + (f", {threads} threads" if threads is not None else "")
    return info | extra


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
