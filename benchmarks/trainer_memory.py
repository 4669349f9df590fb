"""Resident memory over repeated train steps: does the trainer's RSS stay flat?

Builds the policy and `PolicyTrainer` the way a run does (`load_policy`, the default
model, float32 weights) and takes `--steps` steps on synthetic `TokenBatch`es whose
sequence lengths vary from step to step (agent episodes do: `--min-len`..`--max-len`
tokens, `--batch` episodes, the last part of each a policy completion), recording VmRSS
and VmHWM after every step. Each autocast dtype runs in a fresh subprocess (a process's
heap only grows), in these modes:

    plain   the step alone
    trim    the step, then `memory.release_freed_memory()` (glibc malloc_trim(0))
    mmap    trim, and allocations of 1 MB or more served by mmap from the start
            (`memory.map_large_allocations()`)

`--checkpointing` turns on the trainer's gradient checkpointing.

`--threaded` runs each step on a new thread, as a run's trainer does not run on the
thread that loaded the model (glibc gives each thread its own malloc arena).

    python benchmarks/trainer_memory.py --json
    python benchmarks/trainer_memory.py --quick            # 6 steps, short sequences
    python benchmarks/trainer_memory.py --dtypes float32 --modes plain trim --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine, progress_log  # before torch


def _one(args: argparse.Namespace) -> dict[str, Any]:
    """One (dtype, mode) in this process: the per-step RSS record."""
    import random
    import threading

    import torch

    from ridgeline.rl.memory import (
        map_large_allocations, peak_rss_gb, release_freed_memory, rss_gb,
    )
    from ridgeline.rl.policy import PolicyConfig, load_policy
    from ridgeline.rl.tokens import TokenBatch, TokenEpisode
    from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

    torch.set_num_threads(args.threads)
    if args.mode == "mmap":
        map_large_allocations()
    policy = load_policy(PolicyConfig(model=args.model))
    # the trainer's own release_memory off: this script trims (mode "trim") and measures
    trainer = PolicyTrainer(policy, TrainerConfig(
        dtype=args.dtype, release_memory=False, micro_batch_size=args.micro_batch,
        gradient_checkpointing=args.checkpointing))
    vocab = int(policy.model.config.vocab_size)
    rng = random.Random(args.seed)
    loaded = rss_gb()

    def batch() -> TokenBatch:
        eps, adv = [], []
        for _ in range(args.batch):
            n = rng.randint(args.min_len, args.max_len)
            k = max(1, int(n * args.policy_share))
            ep = TokenEpisode.start([rng.randrange(vocab) for _ in range(n - k)])
            ep.add_completion([rng.randrange(vocab) for _ in range(k)],
                              [-rng.uniform(0.1, 3.0) for _ in range(k)], [0] * k)
            eps.append(ep)
            adv.append(rng.uniform(-1, 1))
        return TokenBatch.of(eps, adv)

    steps = []
    for i in range(args.steps):
        b = batch()
        t0 = time.perf_counter()
        if args.threaded:
            th = threading.Thread(target=trainer.step, args=(b,))
            th.start()
            th.join()
        else:
            trainer.step(b)
        step_s = time.perf_counter() - t0
        before_trim = rss_gb()
        trim_s = 0.0
        if args.mode in ("trim", "mmap"):
            t1 = time.perf_counter()
            release_freed_memory()
            trim_s = time.perf_counter() - t1
        row = {"step": i, "shape": list(b.token_ids.shape), "step_s": round(step_s, 2),
               "rss_gb": round(rss_gb() or 0, 3), "peak_rss_gb": round(peak_rss_gb() or 0, 3)}
        if args.mode in ("trim", "mmap"):
            row.update(rss_before_trim_gb=round(before_trim or 0, 3),
                       trim_ms=round(trim_s * 1e3, 1))
        steps.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    rss = [s["rss_gb"] for s in steps]
    half = len(rss) // 2
    return {"dtype": args.dtype, "resolved": trainer_dtype(trainer), "mode": args.mode,
            "threaded": args.threaded, "checkpointing": args.checkpointing,
            "loaded_rss_gb": round(loaded or 0, 3),
            "first_rss_gb": rss[0], "last_rss_gb": rss[-1], "max_rss_gb": max(rss),
            "peak_rss_gb": steps[-1]["peak_rss_gb"],
            # growth per step over the second half (the first steps warm the allocator)
            "late_growth_gb_per_step": round((rss[-1] - rss[half]) / max(len(rss) - 1 - half,
                                                                           1), 4),
            "steps": steps}


def trainer_dtype(trainer: object) -> str:
    return str(getattr(trainer, "autocast_dtype", None) or trainer.config.dtype)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--quick", action="store_true", help="6 steps of 100-400 tokens")
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=1500)
    ap.add_argument("--policy-share", type=float, default=0.3,
                    help="the share of each episode that is policy tokens (loss mask)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--modes", nargs="+", default=["plain", "trim"],
                    choices=["plain", "trim", "mmap"])
    ap.add_argument("--threaded", action="store_true", help="each step on a new thread")
    ap.add_argument("--checkpointing", action="store_true",
                    help="the trainer's gradient checkpointing on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)     # the child's
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.min_len, args.max_len, args.batch = 6, 100, 400, 4
    if args.dtype:  # a child: one configuration
        print(json.dumps(_one(args)))
        return
    say = progress_log(args.json)
    runs = []
    for dtype in args.dtypes:
        for mode in args.modes:
            say(f"{dtype} {mode} ...")
            cmd = [sys.executable, os.path.abspath(__file__), "--dtype", dtype, "--mode", mode,
                   "--model", args.model, "--threads", str(args.threads),
                   "--steps", str(args.steps), "--batch", str(args.batch),
                   "--micro-batch", str(args.micro_batch), "--min-len", str(args.min_len),
                   "--max-len", str(args.max_len), "--policy-share", str(args.policy_share),
                   "--seed", str(args.seed)] + (["--threaded"] if args.threaded else []) \
                + (["--checkpointing"] if args.checkpointing else [])
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if not args.json
                                  else subprocess.DEVNULL, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            say(f"  rss first {run['first_rss_gb']} last {run['last_rss_gb']} max "
                f"{run['max_rss_gb']} peak {run['peak_rss_gb']} GB; late growth "
                f"{run['late_growth_gb_per_step']} GB/step")
            runs.append(run)
    result = {"benchmark": "trainer_memory",
              "config": {k: getattr(args, k) for k in (
                  "model", "steps", "batch", "micro_batch", "min_len", "max_len",
                  "policy_share", "threaded", "seed")},
              "machine": machine(args.threads, malloc_arena_max=os.environ.get(
                  "MALLOC_ARENA_MAX")),
              "runs": runs}
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
