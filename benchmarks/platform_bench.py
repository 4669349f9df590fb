"""Agent platform throughput and latency: N short agent tasks (scripted replies, real
queue, store, workers, checkpoints and signed webhooks) submitted concurrently over HTTP,
on the SQLite queue and on the Redis queue in the same run.

Latency is submit-to-result as a client sees it: from the POST to the arrival of the task's
signed `agent_task.completed` webhook. Every task must arrive exactly once (none lost or
duplicated) or the run fails.

    .venv/bin/python benchmarks/platform_bench.py --json [--tasks 1000] [--sandbox-step]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request
from standardwebhooks.webhooks import Webhook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers
from bench_common import machine  # noqa: E402
from tests.helpers.redis_server import RedisServer, redis_server_path  # noqa: E402

from ridgeline.platform.config import PlatformConfig  # noqa: E402
from ridgeline.platform.service import Platform  # noqa: E402
from ridgeline.serve.app import ServerThread  # noqa: E402


class Receiver:
    def __init__(self, secret: str) -> None:
        self.verifier = Webhook(secret)
        self.arrived: dict[str, float] = {}
        self.duplicates = 0
        self.bad = 0
        self.lock = threading.Lock()
        self.all_in = threading.Event()
        self.expected = 0
        app = FastAPI()

        @app.post("/hook")
        async def hook(request: Request) -> dict:
            body = await request.body()
            try:
                self.verifier.verify(body, dict(request.headers))
            except Exception:
                self.bad += 1
                return {}
            task_id = json.loads(body)["data"]["id"]
            with self.lock:
                if task_id in self.arrived:
                    self.duplicates += 1
                else:
                    self.arrived[task_id] = time.perf_counter()
                    if len(self.arrived) >= self.expected:
                        self.all_in.set()
            return {}

        self.server = ServerThread(app).start()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_backend(backend: str, n_tasks: int, workers: int, sandbox_step: bool,
                redis_url: str | None) -> dict:
    secret = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the receiver's, per task
    receiver = Receiver(secret)
    receiver.expected = n_tasks
    with tempfile.TemporaryDirectory() as tmp:
        queue = {"backend": backend, "lease_s": 30}
        if backend == "redis":
            queue.update(url=redis_url, stream_prefix=f"bench{int(time.time())}")
        config = PlatformConfig.model_validate({
            "data_dir": tmp, "queue": queue,
            "server": {"run_workers": 1, "maintenance_s": 60},
            "worker": {"sandbox": "bwrap",
                       "allow_replay_model": True, "concurrency": workers, "poll_s": 0.05},
            "webhooks": {"allow_private_targets": True},  # the default caps
            "rag": {"embedder": "hashing", "qdrant_path": ":memory:"},
        })
        platform = Platform(config)
        key, _ = platform.keys.create("bench", user="bench")
        api = ServerThread(platform.app()).start()
        replies = (["<bash>echo hi > out.txt</bash>"] if sandbox_step else []) + \
            ["<finish>done</finish>"]
        body = {"instruction": "a short task", "model": "replay", "replay": replies,
                "webhook": {"url": receiver.server.url + "/hook", "secret": secret}}
        submitted: dict[str, float] = {}

        async def submit_all() -> None:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=api.url, limits=limits, timeout=120,
                                         headers={"Authorization": f"Bearer {key}"}) as c:
                sem = asyncio.Semaphore(64)

                async def one(i: int) -> None:
                    async with sem:
                        t0 = time.perf_counter()
                        r = await c.post("/v1/agent/tasks", json=body,
                                         headers={"Idempotency-Key": f"bench-{i}"})
                        r.raise_for_status()
                        submitted[r.json()["id"]] = t0

                await asyncio.gather(*(one(i) for i in range(n_tasks)))

        t_start = time.perf_counter()
        asyncio.run(submit_all())
        t_submitted = time.perf_counter()
        ok = receiver.all_in.wait(timeout=max(120.0, n_tasks * 0.5))
        t_end = time.perf_counter()
        counts = platform.store.counts()
        api.stop()
        platform.close()
        receiver.server.stop()
    latencies = [receiver.arrived[t] - submitted[t] for t in submitted if t in receiver.arrived]
    return {
        "backend": backend, "tasks": n_tasks, "all_arrived": ok,
        "lost": n_tasks - len(receiver.arrived), "duplicates": receiver.duplicates,
        "bad_signatures": receiver.bad, "completed": counts.get("completed", 0),
        "submit_s": round(t_submitted - t_start, 3), "total_s": round(t_end - t_start, 3),
        "throughput_tasks_per_s": round(len(receiver.arrived) / (t_end - t_start), 1),
        "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "latency_p99_s": round(pct(latencies, 0.99), 3) if latencies else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=16, help="worker threads")
    ap.add_argument("--sandbox-step", action="store_true",
                    help="each task runs one bash command in a (local) sandbox first")
    args = ap.parse_args()
    results = []
    results.append(run_backend("sql", args.tasks, args.workers, args.sandbox_step, None))
    if redis_server_path() is not None:
        with RedisServer() as redis:
            results.append(run_backend("redis", args.tasks, args.workers, args.sandbox_step,
                                       redis.url))
    out = {"benchmark": "platform_bench", "date": time.strftime("%Y-%m-%d"),
           "tasks": args.tasks, "workers": args.workers, "sandbox_step": args.sandbox_step,
           "results": results, "machine": machine()}
    if not all(r["lost"] == 0 and r["duplicates"] == 0 for r in results):
        out["error"] = "tasks were lost or duplicated"
    print(json.dumps(out, indent=None if args.json else 2))
    if "error" in out:
        sys.exit(1)


if __name__ == "__main__":
    main()
