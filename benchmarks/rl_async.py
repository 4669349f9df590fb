"""Asynchronous vs synchronous RL on a long-tail workload: wall time to the same reward.

    .venv/bin/python benchmarks/rl_async.py --json [--quick]

The policy is a tiny model trained from scratch on the digit-shift task of the RL tests
(the same engine, buffer, filters, GRPO and trainer as `ridgeline.rl.AsyncRLLoop`). Each
group's episode time is drawn from a heavy-tailed distribution and spent in the reward
function, standing in for agentic episodes whose lengths vary by 10x or more:
`--episode-time lognormal` (sigma 1, the default: a few percent of episodes take 5-10x
the mean) or `pareto` (alpha 1.6, infinite variance: the slowest of 16 groups takes ~5x
the mean, and a strict staleness bound must wait for it every eta + 1 steps).
Rollout threads stay busy while the trainer works when eta > 0; with eta = 0 every step
waits for its slowest group. Both runs use the same seeds, threads and targets. Prints
one JSON object: seconds and steps to the target reward for each eta, and the speedup.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

from bench_common import machine, progress_log  # noqa: I001  (sets the OpenMP policy before torch)

from ridgeline.engine import LLM  # noqa: E402
from ridgeline.rl.digits import DIGITS, shift_reward, shift_tasks, tiny_policy  # noqa: E402
from ridgeline.rl.loop import AsyncRLLoop, LoopConfig  # noqa: E402
from ridgeline.rl.rollouts import TokenTaskRollout  # noqa: E402
from ridgeline.rl.sampler import TaskSampler  # noqa: E402
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig  # noqa: E402


EPISODE_TIMES = {
    # mean 1 before scaling; capped at 100x the mean
    "lognormal": ("LogNormal(-0.5, 1) x mean", lambda rng: rng.lognormvariate(-0.5, 1.0)),
    "pareto": ("Pareto(1.6) x 0.375 mean", lambda rng: 0.375 * rng.paretovariate(1.6)),
}


def run(eta: int, target: float, max_steps: int, threads: int, mean_episode_s: float,
        seed: int, episode_time: str = "lognormal") -> dict:
    model = tiny_policy()
    llm = LLM.from_hf_model(model, num_kv_blocks=1024, block_size=4, max_num_seqs=256,
                            max_num_batched_tokens=2048)
    trainer = PolicyTrainer(model, TrainerConfig(lr=5e-4, micro_batch_size=128))
    rng = random.Random(seed)
    draw = EPISODE_TIMES[episode_time][1]
    draws = iter([mean_episode_s * min(100.0, draw(rng)) for _ in range(100_000)])
    calls = itertools.count()

    def reward(task, completions):
        next(calls)
        time.sleep(next(draws))  # the episode's own time (tool calls, tests)
        return shift_reward(task, completions)

    cfg = LoopConfig(group_size=8, batch_groups=16, eta=eta, rollout_threads=threads)
    loop = AsyncRLLoop(trainer, TaskSampler(shift_tasks(seed), seed),
                       TokenTaskRollout(llm, reward, max_tokens=DIGITS), llm.worker, cfg)
    rewards: list[float] = []
    split = {"wait_seconds": 0.0, "train_seconds": 0.0, "sync_seconds": 0.0,
             "step_seconds": 0.0}
    staleness = 0.0
    t0 = time.perf_counter()
    reached: dict = {}

    def on_step(step: int, m: dict) -> None:
        nonlocal staleness
        rewards.append(m["reward_mean"])
        for k in split:
            split[k] += m.get(k, 0.0)
        staleness = max(staleness, m["staleness_max"])
        if not reached and len(rewards) >= 10 and sum(rewards[-10:]) / 10 >= target:
            reached.update(steps=step + 1, seconds=time.perf_counter() - t0)
            loop.stop()

    loop.run(steps=max_steps, on_step=on_step)
    return {"eta": eta, "reached": bool(reached), "steps": reached.get("steps"),
            "seconds": round(reached.get("seconds", time.perf_counter() - t0), 1),
            "final_reward": round(sum(rewards[-10:]) / max(1, len(rewards[-10:])), 3),
            "max_staleness": staleness, "groups_rolled_out": next(calls),
            "seconds_per_step": {k.removesuffix("_seconds"): round(v / max(1, len(rewards)), 4)
                                 for k, v in split.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smaller target and episodes")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--episode-time", choices=sorted(EPISODE_TIMES), default="lognormal")
    args = ap.parse_args()
    target = 0.6 if args.quick else 0.9
    mean_s = 0.05 if args.quick else 0.2
    log = progress_log(args.json)
    results = {}
    for eta in (0, args.eta):
        log(f"eta={eta} ...")
        results[eta] = run(eta, target, 600, args.threads, mean_s, seed=0,
                           episode_time=args.episode_time)
        log(json.dumps(results[eta]))
    sync, async_ = results[0], results[args.eta]
    out = {"benchmark": "rl_async", "target_reward": target, "threads": args.threads,
           "mean_episode_s": mean_s, "episode_time": EPISODE_TIMES[args.episode_time][0],
           "sync": sync, "async": async_,
           "speedup": (round(sync["seconds"] / async_["seconds"], 2)
                       if sync["reached"] and async_["reached"] else None),
           "goal_speedup": 2.0, "machine": machine(), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
