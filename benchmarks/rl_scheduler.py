"""The domain scheduler against plain FIFO: episodes per second and slot utilisation on
8 task domains with heavy-tailed episode times and one failing domain.

    .venv/bin/python benchmarks/rl_scheduler.py --json [--seconds 20] [--slots 16]

Rollout slots are threads that ask the sampler for the next task, play it (sleep for
the episode's time, as a sandboxed agent episode waits on its tools and tests) and
report it back, the way `AsyncRLLoop`'s rollout threads do. Healthy domain i has
log-normal episode times (sigma 1) with mean 40 ms x (1 + i/2); the failing domain's
episodes hang until their 2 s time limit and end as infrastructure errors (masked, so
useless to training). FIFO is `TaskSampler` (tasks in a shuffled order, no caps); the
scheduler is `DomainScheduler` with its defaults and equal weights (curriculum off: the
simulated episodes have no pass rates). Both runs use the same tasks, slots and
durations. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench_common import machine

from ridgeline.rl.curriculum import CurriculumConfig
from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.protocols import AdaptiveTaskSource
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.scheduler import DomainScheduler, SchedulerConfig

HANG_S = 2.0
TASKS_PER_DOMAIN = 6


@dataclass(frozen=True)
class SimTask:
    id: str
    domain: str
    mean_s: float


@dataclass
class SimGroup:
    task: SimTask
    outcomes: list[EpisodeOutcome] = field(default_factory=list)
    seconds: float = 0.0


def workload(healthy: int) -> list[SimTask]:
    tasks = [SimTask(f"d{i}-{j}", f"d{i}", 0.04 * (1 + i / 2))
             for i in range(healthy) for j in range(TASKS_PER_DOMAIN)]
    return tasks + [SimTask(f"failing-{j}", "failing", HANG_S) for j in range(TASKS_PER_DOMAIN)]


def drive(sampler: Any, slots: int, seconds: float, seed: int) -> dict[str, Any]:
    lock = threading.Lock()
    useful: Counter[str] = Counter()
    started: Counter[str] = Counter()
    busy_useful = [0.0]
    stop = threading.Event()

    def slot(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while not stop.is_set():
            try:
                draw, task = (sampler.draw(timeout=0.2) if isinstance(sampler, DomainScheduler)
                              else sampler.draw())
            except TimeoutError:
                continue
            with lock:
                started[task.domain] += 1
            failed = task.domain == "failing"
            t = HANG_S if failed else min(50 * task.mean_s, task.mean_s
                                          * rng.lognormvariate(-0.5, 1.0))
            t0 = time.perf_counter()
            stop.wait(t)
            took = time.perf_counter() - t0
            verdict = "infra_error" if failed else "passed"
            g = SimGroup(task, [EpisodeOutcome(verdict=verdict, reward=None if failed else 1.0,
                                              detail="agent_timeout" if failed else "")], took)
            if isinstance(sampler, AdaptiveTaskSource):  # the FIFO sampler has no feedback
                sampler.finished(draw, g)
            sampler.done(draw)
            if not failed and not stop.is_set():
                with lock:
                    useful[task.domain] += 1
                    busy_useful[0] += took

    threads = [threading.Thread(target=slot, args=(k,), daemon=True) for k in range(slots)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    wall = time.perf_counter() - t0
    if isinstance(sampler, DomainScheduler):
        sampler.close()
    for t in threads:
        t.join(5)
    healthy = sorted(d for d in started if d != "failing")
    total = sum(useful.values())
    share = {d: round(useful[d] / total * len(healthy), 3) if total else 0.0 for d in healthy}
    return {"episodes_per_s": round(total / wall, 2), "useful_episodes": total,
            "slot_utilisation": round(busy_useful[0] / (slots * wall), 3),
            "starts_failing_domain": started["failing"],
            "min_share_of_fair": min(share.values()) if share else 0.0,
            "share_of_fair": share}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--domains", type=int, default=8, help="healthy domains")
    args = ap.parse_args()
    tasks = workload(args.domains)
    fifo = drive(TaskSampler(tasks, seed=0), args.slots, args.seconds, seed=0)
    sched = DomainScheduler(tasks, SchedulerConfig(curriculum=CurriculumConfig(enabled=False)),
                            slots=args.slots, seed=0)
    mine = drive(sched, args.slots, args.seconds, seed=0)
    out = {"benchmark": "rl_scheduler", "slots": args.slots, "seconds": args.seconds,
           "healthy_domains": args.domains, "failing_domain_hang_s": HANG_S,
           "fifo": fifo, "scheduler": mine,
           "throughput_ratio": round(mine["episodes_per_s"] / max(fifo["episodes_per_s"], 1e-9), 2),
           "goal_ratio": 1.5, "goal_min_share": 0.5, "machine": machine(),
           "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
