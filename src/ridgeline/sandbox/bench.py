"""The sandbox benchmark (`ridgeline sandbox bench`, `benchmarks/sandbox_bench.py`).

Measures, in one run on this machine: cold start (create, run `true`, close) against a
plain `subprocess.run(["true"])` as the baseline, a warm pool's acquire, a command in a
running sandbox, 64 sandboxes at once each running Python, and snapshot / restore of a
1,000-file, 50 MB workspace (a few files changed, and every file changed).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ridgeline.cpu import cpu_info
from ridgeline.sandbox import SandboxPool, SandboxSpec, create_sandbox, get_provider

CONCURRENT_CMD = ["python3", "-c", "import sys; print(sum(range(1000)), sys.version_info[0])"]
CONCURRENT_OUT = "499500 3\n"
GOALS = {"cold_start_p50_ms": 50.0, "warm_acquire_p50_ms": 5.0, "restore_ms": 200.0}


@dataclass
class BenchConfig:
    cold_starts: int = 200
    warm_acquires: int = 200
    execs: int = 100
    concurrent: int = 64
    files: int = 1000
    total_bytes: int = 50 * 1024 * 1024
    backend: str = "bwrap"

    @classmethod
    def quick(cls, backend: str = "bwrap") -> "BenchConfig":
        return cls(cold_starts=30, warm_acquires=50, execs=30, concurrent=16, backend=backend)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def _timed(n: int, fn: Callable[[], None], tick: Callable[[], None]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(_ms(t0))
        tick()
    return out


def _populate(root: Path, files: int, total: int) -> None:
    size = total // files
    block = os.urandom(size)
    for i in range(files):
        d = root / f"pkg{i % 20:02d}"
        d.mkdir(exist_ok=True)
        (d / f"file{i:04d}.bin").write_bytes(block[i % 97:] + block[:i % 97])


def run_bench(cfg: BenchConfig, progress: Callable[[str, int], Callable[[], None]] | None = None
              ) -> dict:
    """Run every measurement; `progress(label, total)` returns a tick function."""
    base_progress = progress or (lambda label, total: (lambda: None))
    phases: dict[str, float] = {}
    last = [time.perf_counter(), ""]

    def progress(label: str, total: int) -> Callable[[], None]:
        now = time.perf_counter()
        if last[1]:
            phases[last[1]] = round(now - last[0], 2)
        last[0], last[1] = now, label
        return base_progress(label, total)

    provider = get_provider(cfg.backend)
    spec = SandboxSpec()
    create_sandbox(spec, backend=cfg.backend).close()  # warm caches: root layout, cgroups
    res: dict = {"backend": cfg.backend}

    def cold() -> None:
        with create_sandbox(spec, backend=cfg.backend) as sb:
            if sb.run(["true"]).exit_code != 0:
                raise RuntimeError("`true` failed in a fresh sandbox")

    # Baseline and cold start interleaved, so that both see the same machine load.
    tick = progress("cold start (and subprocess baseline)", cfg.cold_starts)
    base, cold_ms = [], []
    for _ in range(cfg.cold_starts):
        base += _timed(1, lambda: subprocess.run(["true"], check=True), lambda: None)
        cold_ms += _timed(1, cold, tick)
    res.update(cold_start_p50_ms=statistics.median(cold_ms), cold_start_p95_ms=_pct(cold_ms, 0.95),
               cold_starts=cfg.cold_starts, subprocess_p50_ms=statistics.median(base),
               subprocess_p95_ms=_pct(base, 0.95))
    res["cold_start_vs_subprocess"] = res["cold_start_p50_ms"] / res["subprocess_p50_ms"]

    with create_sandbox(spec, backend=cfg.backend) as sb:
        tick = progress("exec in a running sandbox", cfg.execs)
        ex = _timed(cfg.execs, lambda: sb.run(["true"]), tick)
    res.update(exec_p50_ms=statistics.median(ex), exec_p95_ms=_pct(ex, 0.95))

    tick = progress("warm pool acquire", cfg.warm_acquires)
    acq: list[float] = []
    with SandboxPool(spec, size=4, backend=cfg.backend) as pool:
        for _ in range(cfg.warm_acquires):
            t0 = time.perf_counter()
            sb = pool.acquire(timeout=60)
            acq.append(_ms(t0))
            sb.run(["true"])
            pool.release(sb)
            tick()
        res["pool_resets"] = pool.resets
    res.update(warm_acquire_p50_ms=statistics.median(acq), warm_acquire_p95_ms=_pct(acq, 0.95))

    tick = progress(f"{cfg.concurrent} sandboxes at once", cfg.concurrent)
    failures: list[str] = []

    def one(_: int) -> None:
        try:
            with create_sandbox(spec, backend=cfg.backend) as sb:
                r = sb.run(CONCURRENT_CMD, timeout=120)
                if r.stdout != CONCURRENT_OUT:
                    failures.append(f"exit {r.exit_code}: {r.stderr[-200:]}")
        except Exception as e:  # noqa: BLE001 - every failure is counted and reported
            failures.append(f"{type(e).__name__}: {e}")
        tick()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=cfg.concurrent) as ex_:
        list(ex_.map(one, range(cfg.concurrent)))
    res["concurrent"] = {"sandboxes": cfg.concurrent, "failures": len(failures),
                         "seconds": time.perf_counter() - t0, "command": " ".join(CONCURRENT_CMD),
                         "errors": failures[:3]}

    tick = progress("snapshot / restore", 5)
    seed = Path(tempfile.mkdtemp(prefix="ridgeline-bench-"))
    try:
        _populate(seed, cfg.files, cfg.total_bytes)
        with create_sandbox(SandboxSpec(workspace_from=seed), backend=cfg.backend) as sb:
            t0 = time.perf_counter()
            snap = sb.snapshot()
            res["snapshot_ms"] = _ms(t0)
            tick()
            ws = sb.workspace_dir
            # a typical agent step: a few files edited, some added, some deleted
            files = sorted(ws.rglob("*.bin"))
            for f in files[:25]:
                with open(f, "ab") as fh:
                    fh.write(b"edit")
            (ws / "new").mkdir()
            for i in range(10):
                (ws / "new" / f"{i}.txt").write_text(str(i))
            for f in files[-5:]:
                f.unlink()
            t0 = time.perf_counter()
            sb.restore(snap)
            res["restore_ms"] = _ms(t0)
            tick()
            t0 = time.perf_counter()
            sb.restore(snap)
            res["restore_unchanged_ms"] = _ms(t0)
            tick()
            for f in ws.rglob("*.bin"):  # every file edited in place
                with open(f, "r+b") as fh:
                    fh.seek(7)
                    fh.write(b"x")
            t0 = time.perf_counter()
            sb.restore(snap)
            res["restore_all_changed_ms"] = _ms(t0)
            tick()
            t0 = time.perf_counter()
            sb.snapshot()
            res["snapshot_incremental_ms"] = _ms(t0)
            tick()
        res["workspace"] = {"files": cfg.files, "bytes": cfg.total_bytes,
                            "typical_step": "25 files edited, 11 entries added, 5 deleted"}
    finally:
        shutil.rmtree(seed, ignore_errors=True)

    phases[last[1]] = round(time.perf_counter() - last[0], 2)
    res["phase_seconds"] = phases
    res["goals"] = {k: {"goal_ms": v, "met": res[k] <= v} for k, v in GOALS.items()}
    res["goals"]["concurrent_failures"] = {"goal": 0, "met": res["concurrent"]["failures"] == 0}
    cpu = cpu_info()  # results compare only with baselines from the same CPU generation
    res["machine"] = {
        "cpu_model": cpu.model, "cpu_flags": cpu.simd_flags,
        "cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
        "cgroups": getattr(provider, "cgroups", None) is not None,
        "disk_volumes": getattr(provider, "volumes", None) is not None,
        "workspace_root": str(getattr(provider, "root", "")),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load_avg_1m": os.getloadavg()[0],
    }
    return res
