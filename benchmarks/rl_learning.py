"""Does training make the default model a better agent on tasks it has never seen?
SmolLM2-135M-Instruct, per seed: the base model, SFT on oracle episodes of the training
families (`ridgeline sft`), then RL from the SFT checkpoint on fresh instances of the
training families (`ridgeline train`), each evaluated with `ridgeline eval`'s code on
the held-out families with the same sampling.

    .venv/bin/python benchmarks/rl_learning.py --json [--seeds 0 1 2] [--minutes 60]

What is held out: whole task families (`ridgeline tasks families`, split `heldout`),
not instances of trained templates. Their instructions state the goal only (never the
command), and each exercises a skill of the training families with another goal
(training counts lines of a kind, held-out finds the longest line; training sorts
numbers, held-out takes a median; ...). The held-out instances use their own seeds.

Prints one JSON object: `heldout_pass_rate` {base, sft, sft_rl} (means over seeds,
0-1), `gain_points_sft_rl_over_base`, `gain_points_sft_rl_over_sft`, per seed each
evaluation's pass@1 with its 95% bootstrap interval over tasks, infrastructure errors
apart, `checkpoints` (each seed's final RL checkpoint), `peak_rss_gb` (the largest
resident memory of any stage: each evaluation, SFT and RL runs in its own process, as the
`ridgeline` commands do, with its own peak beside its result), minutes per seed and the
machine. Plots (held-out pass rates with intervals, SFT loss,
RL reward) go to OUT/plots/. Goal (issue 27): SFT+RL >= base + 25 points and >= SFT + 5
points on every seed, within 1 hour of CPU per seed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench_common import machine, progress_log  # noqa: I001  (sets the OpenMP policy before torch)

from ridgeline.eval.runner import EvalConfig, run_eval  # noqa: E402
from ridgeline.llm.base import Sampling  # noqa: E402
from ridgeline.rl.config import FamilySelection, RolloutSettings  # noqa: E402
from ridgeline.rl.memory import peak_rss_gb  # noqa: E402
from ridgeline.rl.parts import family_tasks, rollout_agent_config  # noqa: E402
from ridgeline.rl.run import TrainConfig, train  # noqa: E402
from ridgeline.rl.sft import SFTConfig, sft  # noqa: E402
from ridgeline.tasks import VerdictStatus  # noqa: E402
from ridgeline.tasks.families import families  # noqa: E402

# One sampling for every rollout and evaluation: at temperature 0.7 the base model still
# writes parseable actions; top_p 1 keeps RL's behaviour logprobs exact.
TEMPERATURE = 0.7
ROLLOUT = RolloutSettings(temperature=TEMPERATURE, max_tokens=192, step_limit=6)
HELDOUT_SEED = 10_000      # held-out instances: seeds 10000.. (training uses 0..)


def heldout_tasks(root: Path, instances: int) -> Path:
    """Every held-out family's instances, generated and quality-checked once."""
    tasks, excluded = family_tasks(FamilySelection(split="heldout", instances=instances,
                                                   seed=HELDOUT_SEED), root, ROLLOUT.backend)
    if excluded:
        print(json.dumps({"heldout_excluded": excluded}))
    return root


def in_own_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a fresh (spawned) process, as a user runs `ridgeline eval`, `sft`
    and `train` one after another: each stage's memory is its own and is returned to the
    system when it ends, and its high-water mark is measured alone (`peak_rss_gb`)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_measured, fn, *args).result()


def _measured(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    out = fn(*args)
    out["peak_rss_gb"] = round(peak_rss_gb() or 0.0, 2)
    return out


def evaluate(model: str, tasks_dir: Path, out: Path, seed: int, samples: int) -> dict[str, Any]:
    # the agent as rollouts run it (RL's prompts and limits), sampling as in training
    agent = rollout_agent_config(ROLLOUT).model_copy(update={"sampling": Sampling(
        temperature=TEMPERATURE, top_p=1.0, max_tokens=ROLLOUT.max_tokens, seed=seed)})
    run = run_eval(EvalConfig(tasks=str(tasks_dir), model=model, samples=samples,
                              concurrency=8, out=out, backend=ROLLOUT.backend,
                              agent_config=agent))
    s = run.summary
    return {"pass_rate": s.pass_rate, "pass_at_1_ci95": s.pass_at_1_ci95,
            "episodes": s.n_episodes, "scored": s.n_scored, "infra_errors": s.n_infra_error,
            "per_family": _per_family(run.results), "dir": str(out)}


def _per_family(results: list[Any]) -> dict[str, float]:
    by: dict[str, list[bool]] = {}
    for r in results:
        if r.scored:
            by.setdefault(r.task_id.rsplit("-", 1)[0], []).append(
                r.status is VerdictStatus.PASSED)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


def run_seed(seed: int, out: Path, heldout: Path, minutes: float, args: argparse.Namespace,
             log: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    res: dict[str, Any] = {"seed": seed}
    log(f"seed {seed}: base model on the held-out families")
    res["base"] = in_own_process(evaluate, "default", heldout, out / "eval-base", seed,
                                 args.samples)
    log(f"seed {seed}: base {res['base']['pass_rate']:.3f}; SFT")
    sft_cfg = SFTConfig.model_validate({
        "tasks": {"families": {"split": "train", "instances": args.sft_instances,
                               "seed": 0}},
        "epochs": args.sft_epochs, "batch_size": 8, "seed": seed, "out": str(out / "sft"),
        "trainer": {"lr": args.sft_lr, "micro_batch_size": 4},
        "rollout": ROLLOUT.model_dump(), "checkpoint_every": 50})
    res["sft_run"] = in_own_process(run_sft, sft_cfg)
    res["sft"] = in_own_process(evaluate, str(out / "sft"), heldout, out / "eval-sft", seed,
                                args.samples)
    log(f"seed {seed}: SFT {res['sft']['pass_rate']:.3f}; RL from it")
    used = (time.perf_counter() - t0) / 60
    # RL gets what is left of the hour, minus room for the last evaluation
    rl_minutes = max(1.0, minutes - used - args.eval_minutes)
    rl_cfg = TrainConfig.model_validate({
        "policy": {"model": str(out / "sft")},
        # fresh instances of the training families (SFT saw seeds 0..n-1)
        "tasks": {"families": {"split": "train", "instances": args.rl_instances,
                               "seed": 1000}},
        "steps": 10_000, "time_limit_s": rl_minutes * 60, "seed": seed,
        "out": str(out / "rl"), "checkpoint_every": 10,
        "trainer": {"lr": args.rl_lr, "micro_batch_size": 4, "grad_clip": 1.0},
        "loop": {"group_size": 4, "batch_groups": 4, "eta": 1, "rollout_threads": 2,
                 "filters": {"limit_policy": "score"}},
        "rollout": ROLLOUT.model_dump(), "engine": {"max_num_seqs": 32}})
    res["rl_run"] = in_own_process(run_rl, rl_cfg)
    res["rl_reward"] = res["rl_run"].pop("reward")
    res["sft_rl"] = in_own_process(evaluate, str(out / "rl"), heldout, out / "eval-sft-rl",
                                   seed, args.samples)
    res["checkpoint"] = str(out / "rl" / "checkpoint")
    res["minutes"] = round((time.perf_counter() - t0) / 60, 1)
    res["peak_rss_gb"] = max(res[k]["peak_rss_gb"]
                             for k in ("base", "sft_run", "sft", "rl_run", "sft_rl"))
    log(f"seed {seed}: SFT+RL {res['sft_rl']['pass_rate']:.3f} after "
        f"{res['rl_run']['steps']} RL steps, "
        f"{res['minutes']} min")
    return res


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    s = sft(cfg)
    return {"steps": s.steps_done, "episodes": s.episodes}


def run_rl(cfg: TrainConfig) -> dict[str, Any]:
    r = train(cfg)
    return {"steps": r.steps_done, "reward": [m.get("reward_mean") for m in r.history]}


def plot(out: Path, seeds: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ridgeline.rl.run_log import read_metrics

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for i, s in enumerate(seeds):
        for j, stage in enumerate(("base", "sft", "sft_rl")):
            e = s[stage]
            lo, hi = e["pass_at_1_ci95"] or (e["pass_rate"], e["pass_rate"])
            x = j + (i - (len(seeds) - 1) / 2) * 0.2
            ax.errorbar(x, 100 * e["pass_rate"], yerr=[[100 * (e["pass_rate"] - lo)],
                        [100 * (hi - e["pass_rate"])]], fmt="o", capsize=4,
                        color=f"C{i}", label=f"seed {s['seed']}" if j == 0 else None)
    ax.set_xticks([0, 1, 2], ["base", "SFT", "SFT + RL"])
    ax.set_ylim(-3, 103)
    ax.set_ylabel("held-out pass@1 (%), 95% interval")
    ax.set_title("Held-out families")
    ax.legend(fontsize=8)
    for i, s in enumerate(seeds):
        sft_m = read_metrics(out / f"seed-{s['seed']}" / "sft")
        axes[1].plot([m["step"] for m in sft_m], [m["sft/nll"] for m in sft_m], color=f"C{i}",
                     marker="o", markersize=3)
        rl = [(k, v) for k, v in enumerate(s["rl_reward"]) if v is not None]
        axes[2].plot([k for k, _ in rl], [v for _, v in rl], color=f"C{i}", marker="o",
                     markersize=3, label=f"seed {s['seed']}")
    axes[1].set_title("SFT: NLL of the policy tokens")
    axes[1].set_xlabel("step")
    axes[2].set_title("RL: training reward (fresh training-family instances)")
    axes[2].set_xlabel("step")
    axes[2].set_ylim(-0.03, 1.03)
    fig.tight_layout()
    path = plots / "rl_learning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=60.0, help="budget per seed")
    ap.add_argument("--eval-minutes", type=float, default=6.0,
                    help="time kept back for the final evaluation")
    ap.add_argument("--heldout-instances", type=int, default=2, help="per held-out family")
    ap.add_argument("--samples", type=int, default=2, help="episodes per held-out task")
    # 31 training families since the building blocks: 4 instances x 2 epochs keeps SFT
    # near 31 steps of 8 episodes (~20 min here), as 15 families x 8 x 3 was
    ap.add_argument("--sft-instances", type=int, default=4, help="per training family")
    ap.add_argument("--sft-epochs", type=int, default=2)
    ap.add_argument("--sft-lr", type=float, default=2e-5)
    ap.add_argument("--rl-instances", type=int, default=8, help="per training family")
    ap.add_argument("--rl-lr", type=float, default=5e-6)
    ap.add_argument("--out", type=Path, default=Path("runs/rl-learning"))
    args = ap.parse_args()
    log = progress_log(args.json)
    t0 = time.perf_counter()
    heldout = heldout_tasks(args.out / "heldout-tasks", args.heldout_instances)
    seeds = [run_seed(s, args.out / f"seed-{s}", heldout, args.minutes, args, log)
             for s in args.seeds]

    def mean(stage: str) -> float:
        return statistics.fmean(s[stage]["pass_rate"] for s in seeds)

    rates = {k: round(mean(k), 4) for k in ("base", "sft", "sft_rl")}
    out = {
        "benchmark": "rl_learning", "model": "SmolLM2-135M-Instruct (default)",
        "heldout_families": [f.name for f in families("heldout")],
        "training_families": [f.name for f in families("train")],
        "heldout_tasks": len([p for p in heldout.iterdir() if p.is_dir()]),
        "samples_per_task": args.samples, "temperature": TEMPERATURE,
        "heldout_pass_rate": rates,
        "gain_points_sft_rl_over_base": round(100 * (rates["sft_rl"] - rates["base"]), 1),
        "gain_points_sft_rl_over_sft": round(100 * (rates["sft_rl"] - rates["sft"]), 1),
        "per_seed": seeds,
        "checkpoints": {str(s["seed"]): s["checkpoint"] for s in seeds},
        # the largest resident memory of any stage (each runs in its own process, as
        # `ridgeline eval / sft / train` do); per stage under per_seed[i][stage]
        "peak_rss_gb": max(s["peak_rss_gb"] for s in seeds),
        "minutes_total": round((time.perf_counter() - t0) / 60, 1),
        "minutes_budget_per_seed": args.minutes, "goal_points": {"over_base": 25, "over_sft": 5},
        "plots": plot(args.out, seeds), "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
