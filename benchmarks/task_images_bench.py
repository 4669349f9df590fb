"""Task images (tasks/images.py): what a real build costs, and what a sandbox on a built
image costs to start, beside today's host-root mode in the same run.

    .venv/bin/python benchmarks/task_images_bench.py            # ~1-2 min, one JSON object
    .venv/bin/python benchmarks/task_images_bench.py --starts 40

Measured:
* `first_build_s`: a typical task (FROM python:3.13-slim, apt-get install curl, pip
  install pytest and requests, COPY, WORKDIR) built with `--no-cache` (every layer of
  the task rebuilt; the base images are built once per machine and not counted), apt
  and pip reaching the registries.
* `cached_build_s`: the same task again from a fresh builder (a podman lookup, median),
  and `memo_build_s` from the same process (no podman call, median).
* Cold start, p50/p95 over `--starts`: `sandbox_start` is create_sandbox() on the
  image's root plus the first command (`true`); `prepare_environment` is the whole
  task environment (staging, the sandbox, the image's WORKDIR seeded) plus `true`.
  Baseline: the same two for the host-root mode (the Dockerfile interpreted onto the
  host's /), on a task both modes can run (tests/tasks/fixtures/tb1-csv-summary).
* Fork: a bwrap sandbox on the built image with a 50 MB workspace (random bytes in 50
  files), then 8 forks. `freeze_ms` is the one-off copy of the prepared workspace into
  the shared base; `per_fork` p50/p95 is each fork's start (overlay mount, chown of
  metadata, sandbox start, first command); `host_kib_per_fork` is what each fork's own
  filesystem holds before it writes (its volume's used blocks beyond an empty
  sandbox's), against the 50 MB a copy would hold.
Goals (issue 28): sandbox cold start p50 <= 50 ms on a cached image; fork p50 <= 50 ms
per sandbox with no bytes copied until written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import machine

from ridgeline.sandbox import Limits, SandboxSpec, create_sandbox
from ridgeline.sandbox import fork as forks
from ridgeline.tasks import load_task, prepare_environment
from ridgeline.tasks.images import ImageBuilder, builder

FIXTURE = Path(__file__).resolve().parents[1] / "tests/tasks/fixtures/tb1-csv-summary"
TYPICAL = """\
FROM python:3.13-slim
RUN apt-get update && apt-get install -y --no-install-recommends curl \\
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir pytest==8.4.1 requests==2.32.3
WORKDIR /app
COPY data.txt /app/data.txt
"""


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(1000 * statistics.median(xs), 1),
            "p95_ms": round(1000 * xs[min(len(xs) - 1, int(0.95 * len(xs)))], 1),
            "n": len(xs)}


def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _used_kib(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


def _fork(rootfs: Path, n: int = 8) -> dict:
    spec = SandboxSpec(tools_root=rootfs, workspace_path="/app",
                       limits=Limits(disk_bytes=256 << 20))
    with create_sandbox(spec) as parent:
        assert parent.run("for i in $(seq 50); do head -c 1000000 /dev/urandom > f$i; "
                          "done").ok
        with create_sandbox(spec) as empty:
            baseline = _used_kib(empty.workspace_dir)
        t0 = time.perf_counter()
        base = forks.ForkBase.freeze(parent.workspace_dir, parent.dir.parent /
                                     f"{os.getpid()}-fork-bench", None)
        freeze = time.perf_counter() - t0
        kids, times = [], []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                kid = type(parent)(parent._p, spec.model_copy(), fork_base=base)
                kid.run("true")
                times.append(time.perf_counter() - t0)
                kids.append(kid)
            used = [_used_kib(k.workspace_dir) - baseline for k in kids]
            same = all(k.run("cat f7").stdout_bytes == parent.run("cat f7").stdout_bytes
                       for k in kids[:2])
        finally:
            for k in kids:
                k.close()
            base.release()
    return {"n": n, "workspace_mb": 50, "freeze_ms": round(1000 * freeze, 1),
            "per_fork": _pcts(times), "host_kib_per_fork": max(used),
            "content_identical": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--skip-first-build", action="store_true")
    args = ap.parse_args()
    b = builder()
    if (why := b.unavailable_reason()) is not None:
        sys.exit(f"task images unavailable here: {why}")
    result: dict = {"benchmark": "task_images", "machine": machine()}

    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        (ctx / "Dockerfile").write_text(TYPICAL)
        (ctx / "data.txt").write_text("hello\n")
        if not args.skip_first_build:
            first = b.build(ctx / "Dockerfile", ctx, no_cache=True)
            result["first_build_s"] = round(first.build_s, 2)
        cached = _time(lambda: ImageBuilder().build(ctx / "Dockerfile", ctx), 5)
        memo = _time(lambda: b.build(ctx / "Dockerfile", ctx), 5)
        result["cached_build_s"] = round(statistics.median(cached), 3)
        result["memo_build_s"] = round(statistics.median(memo), 4)

    task = load_task(FIXTURE)
    image = b.build(task.build.source, task.build.context)

    def start(root: Path | None):
        spec = SandboxSpec(tools_root=root) if root is not None else SandboxSpec()
        with create_sandbox(spec) as sb:
            sb.run("true")

    def prepare(mode: str):
        with prepare_environment(task, mode=mode) as sb:
            sb.run("true")

    for warm in (lambda: start(image.rootfs), lambda: start(None),
                 lambda: prepare("image"), lambda: prepare("host")):
        warm()
    starts: dict[str, list[float]] = {k: [] for k in
                                      ("image_sandbox", "host_sandbox", "image_prepare",
                                       "host_prepare")}
    for _ in range(args.starts):   # interleaved, so drift hits both modes alike
        starts["image_sandbox"] += _time(lambda: start(image.rootfs), 1)
        starts["host_sandbox"] += _time(lambda: start(None), 1)
        starts["image_prepare"] += _time(lambda: prepare("image"), 1)
        starts["host_prepare"] += _time(lambda: prepare("host"), 1)
    result["cold_start"] = {
        "image": {"sandbox_start": _pcts(starts["image_sandbox"]),
                  "prepare_environment": _pcts(starts["image_prepare"])},
        "host_root_baseline": {"sandbox_start": _pcts(starts["host_sandbox"]),
                               "prepare_environment": _pcts(starts["host_prepare"])},
        "task": FIXTURE.name,
    }
    result["fork"] = _fork(image.rootfs)
    p50 = result["cold_start"]["image"]["sandbox_start"]["p50_ms"]
    fork_p50 = result["fork"]["per_fork"]["p50_ms"]
    result["goal"] = {"sandbox_start_p50_ms_max": 50, "fork_p50_ms_max": 50,
                      "met": p50 <= 50 and fork_p50 <= 50}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
