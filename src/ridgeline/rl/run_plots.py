"""A training run's plots: PNGs drawn from its metrics.jsonl (`run_log.py` writes it).

    plot_run(run_dir)      # -> {name: path} under run_dir/plots/

reward, pass_rate_by_domain, staleness, time_split, throughput, mismatch (sampler vs
trainer logprobs, and the share of tokens the rollout correction cut) and eval; a plot whose
metrics are absent (or never finite) is skipped. The metric keys are listed in
`run_log`'s docstring. matplotlib (Agg) is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ridgeline.rl.run_log import PLOTS_DIR, RESERVED, MetricsRecord, is_number, read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: Per logged step: its step and its numbers by tag (dicts flattened as for TensorBoard;
#: None where a NaN was logged).
Flat = list[tuple[int, dict[str, float | None]]]

_BLUE, _GREEN, _ORANGE, _RED, _GREY = "#3b7dd8", "#2e9e5b", "#e08a1e", "#c9503c", "#8c8c8c"


def _series(flat: Flat, *keys: str
            ) -> tuple[list[int], list[float]] | None:
    """(steps, values) of the first of `keys` each record has; None if no finite value.
    None (a logged NaN) becomes NaN, a gap in the line."""
    steps, values = [], []
    for step, rec in flat:
        for key in keys:
            if key in rec:
                v = rec[key]
                steps.append(step)
                values.append(float(v) if is_number(v) else math.nan)
                break
    if not any(math.isfinite(v) for v in values):
        return None
    return steps, values


def _flat_all(records: Iterable[MetricsRecord]) -> Flat:
    """Per record: its step and its tags (dicts flattened as for TensorBoard, None kept)."""
    def flat(m: Mapping[str, object], prefix: str = "") -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for k, v in m.items():
            if isinstance(v, Mapping):
                out.update(flat(v, f"{prefix}{k}/"))
            elif v is None or is_number(v):
                out[f"{prefix}{k}"] = v
        return out
    return [(rec["step"], flat({k: v for k, v in rec.items() if k not in RESERVED}))
            for rec in records]


def _moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        win = [v for v in values[max(0, i - window + 1): i + 1] if math.isfinite(v)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def _figure(width: float = 8.0, height: float = 4.5) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # Agg, without pyplot's global state
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    ax.set_axisbelow(True)
    return fig, ax


def _steps_axis(ax: Axes) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    lo, hi = ax.get_xlim()
    if hi - lo < 2:  # a single step: a readable axis, not ticks at 0.015 apart
        mid = (lo + hi) / 2
        ax.set_xlim(mid - 1, mid + 1)


def _marker(n: int) -> dict[str, str | int]:
    return {"marker": "o", "markersize": 4 if n <= 50 else 2}


def _save_per_step(fig: Figure, ax: Axes, title: str, ylabel: str, out_dir: Path, name: str,
                   paths: dict[str, Path], /, **legend: object) -> None:
    """Finish a plot over training steps (title, y label, steps axis, a small legend whose
    options `legend` overrides: positional-only above, so it may hold a `title`) and save it."""
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    _steps_axis(ax)
    ax.legend(**{"loc": "best", "fontsize": 8, **legend})
    _save(fig, out_dir, name, paths)


def _save(fig: Figure, out_dir: Path, name: str, paths: dict[str, Path]) -> None:
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    paths[name] = path


def _bar_width(steps: list[int]) -> float:
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return 0.8 * min(gaps) if gaps else 0.8


def _plot_reward(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    reward, passed = _series(flat, "reward_mean"), _series(flat, "pass_rate")
    if reward is None and passed is None:
        return
    fig, ax = _figure()
    if reward is not None:
        steps, values = reward
        ax.plot(steps, values, color=_BLUE, alpha=0.45, linewidth=1, label="mean reward",
                **_marker(len(steps)))
        if len(steps) >= 4:
            window = max(3, min(50, len(steps) // 10))
            ax.plot(steps, _moving_average(values, window), color=_BLUE, linewidth=2.2,
                    label=f"mean reward, moving average of {window} steps")
    if passed is not None:
        steps, values = passed
        ax.plot(steps, values, color=_GREEN, linewidth=1.5, label="pass rate (fraction)",
                **_marker(len(steps)))
    _save_per_step(fig, ax, "Training reward per step", "mean episode reward / pass rate (0-1)",
                   out_dir, "reward", paths)


def _plot_sft(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    nll = _series(flat, "sft/nll")
    if nll is None:
        return
    fig, ax = _figure()
    steps, values = nll
    ax.plot(steps, values, color=_BLUE, linewidth=1.5, label="NLL of the policy tokens",
            **_marker(len(steps)))
    _save_per_step(fig, ax, "SFT loss per step", "mean negative log-likelihood (nats per token)",
                   out_dir, "sft_loss", paths)


def _plot_domains(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    domains = sorted({k[len("pass_rate/"):] for _, rec in flat for k in rec
                      if k.startswith("pass_rate/")})
    lines = [(d, s) for d in domains if (s := _series(flat, f"pass_rate/{d}")) is not None]
    if not lines:
        return
    fig, ax = _figure(9 if len(lines) > 6 else 8)
    for domain, (steps, values) in lines:
        ax.plot(steps, [100 * v for v in values], linewidth=1.5, label=domain,
                **_marker(len(steps)))
    ax.set_ylim(-3, 103)
    _save_per_step(fig, ax, "Training pass rate by task domain",
                   "pass rate (% of the step's scored episodes)", out_dir, "pass_rate_by_domain",
                   paths, ncol=2 if len(lines) > 6 else 1, title="domain", title_fontsize=8)


def _plot_staleness(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    counts: dict[int, float] = {}
    for _, rec in flat:
        for k, v in rec.items():
            if not k.startswith("staleness_hist/") or not is_number(v) or not math.isfinite(v):
                continue
            try:
                lag = int(k[len("staleness_hist/"):])
            except ValueError:
                continue
            counts[lag] = counts.get(lag, 0.0) + v
    total = sum(counts.values())
    if not counts or total <= 0:
        return
    lags = sorted(counts)
    fig, ax = _figure(max(6.0, min(12.0, 0.6 * len(lags) + 4)))
    bars = ax.bar(lags, [counts[lag] for lag in lags], color=_ORANGE, width=0.7)
    for bar, lag in zip(bars, lags):
        ax.annotate(f"{100 * counts[lag] / total:.0f}%",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    mean = sum(lag * c for lag, c in counts.items()) / total
    ax.set_xticks(lags)
    ax.set_title(f"Staleness of trained tokens, all steps (mean {mean:.2f} versions)")
    ax.set_xlabel("policy versions between sampling and training (lag)")
    ax.set_ylabel("trained tokens")
    ax.margins(y=0.12)
    _save(fig, out_dir, "staleness", paths)


def _plot_time_split(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    parts = [(("rollout_wait_seconds", "wait_seconds"), "waiting for rollouts", _GREY),
             (("train_seconds",), "training (optimizer step)", _BLUE),
             (("sync_seconds",), "weight sync to the engine", _ORANGE)]
    found = [(keys, label, color, s) for keys, label, color in parts
             if (s := _series(flat, *keys)) is not None]
    if not found:
        return
    steps = sorted({step for *_, (ss, _) in found for step in ss})
    by_step = {step: rec for step, rec in flat}

    def value(step: int, keys: tuple[str, ...]) -> float:
        for k in keys:
            v = by_step[step].get(k)
            if is_number(v) and math.isfinite(v):
                return max(0.0, float(v))
        return 0.0

    stacks = [(label, color, [value(s, keys) for s in steps]) for keys, label, color, _ in found]
    other = []
    for i, s in enumerate(steps):
        total = by_step[s].get("step_seconds")
        known = sum(vals[i] for *_, vals in stacks)
        other.append(max(0.0, total - known) if is_number(total) and math.isfinite(total)
                     else 0.0)
    if any(v > 0 for v in other):
        stacks.append(("other (filters, advantages, bookkeeping)", "#c7c7c7", other))
    fig, ax = _figure()
    bottom = [0.0] * len(steps)
    width = _bar_width(steps)
    for label, color, vals in stacks:
        ax.bar(steps, vals, bottom=bottom, width=width, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, 1.3 * max(max(bottom), 1e-3))  # headroom for the legend
    _save_per_step(fig, ax, "Where each training step's time went", "seconds", out_dir,
                   "time_split", paths, loc="upper left", ncol=2)


def _plot_throughput(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    lines = [(label, color, s) for key, label, color in
             (("rollout_tokens_per_s", "rollouts (generated tokens)", _GREEN),
              ("train_tokens_per_s", "training (trained tokens)", _BLUE))
             if (s := _series(flat, key)) is not None]
    if not lines:
        return
    fig, ax = _figure()
    for label, color, (steps, values) in lines:
        ax.plot(steps, values, color=color, linewidth=1.5, label=label, **_marker(len(steps)))
    finite = [v for *_, (_, vals) in lines for v in vals if math.isfinite(v)]
    if len(lines) > 1 and min(finite) > 0 and max(finite) / min(finite) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    _save_per_step(fig, ax, "Throughput per training step", "tokens per second", out_dir,
                   "throughput", paths)


def _plot_mismatch(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    """The sampler/trainer mismatch on the trained tokens (left) and the share of tokens the
    rollout correction truncated or masked (right)."""
    lines = [(label, color, s) for key, label, color in
             (("mismatch/kl_k3", "KL(behaviour || trainer), k3", _BLUE),
              ("mismatch/log_ppl_ratio", "log(PPL trainer / PPL behaviour)", _GREEN))
             if (s := _series(flat, key)) is not None]
    shares = [(label, color, s) for key, label, color in
              (("behaviour_weight_capped", "truncated (tis)", _ORANGE),
               ("behaviour_weight_masked", "masked (mis)", _RED))
              if (s := _series(flat, key)) is not None and any(v > 0 for v in s[1])]
    if not lines:
        return
    fig, ax = _figure()
    for label, color, (steps, values) in lines:
        ax.plot(steps, values, color=color, linewidth=1.5, label=label, **_marker(len(steps)))
    ax.axhline(0.0, color=_GREY, linewidth=0.8)
    handles = ax.get_legend_handles_labels()[0]
    if shares:
        right = ax.twinx()
        for label, color, (steps, values) in shares:
            right.plot(steps, [100 * v for v in values], color=color, linewidth=1,
                       linestyle="--", label=label)
        right.set_ylabel("tokens truncated / masked (%)")
        right.set_ylim(0, 100)   # shares: the whole range, never clipped
        handles += right.get_legend_handles_labels()[0]   # one legend for both axes
    _save_per_step(fig, ax, "Sampler / trainer mismatch on the recorded tokens",
                   "nats per token", out_dir, "mismatch", paths, loc="upper left",
                   handles=handles)


def _plot_eval(flat: Flat, out_dir: Path, paths: dict[str, Path]) -> None:
    overall = _series(flat, "eval/pass_rate")
    domains = sorted({k[len("eval/pass_rate/"):] for _, rec in flat for k in rec
                      if k.startswith("eval/pass_rate/")})
    lines = [(d, s) for d in domains if (s := _series(flat, f"eval/pass_rate/{d}")) is not None]
    if overall is None and not lines:
        return
    fig, ax = _figure()
    for domain, (steps, values) in lines:
        ax.plot(steps, [100 * v for v in values], linewidth=1, linestyle="--", alpha=0.7,
                label=domain, **_marker(len(steps)))
    if overall is not None:
        steps, values = overall
        ax.plot(steps, [100 * v for v in values], color="black", linewidth=2.2,
                label="all held-out tasks", **_marker(len(steps)))
        if len(steps) <= 20:
            for s, v in zip(steps, values):
                if math.isfinite(v):
                    ax.annotate(f"{100 * v:.0f}%", (s, 100 * v), textcoords="offset points",
                                xytext=(0, 6), ha="center", fontsize=8)
    ax.set_ylim(-3, 108)
    _save_per_step(fig, ax, "Held-out evaluation pass rate", "pass rate (% of scored episodes)",
                   out_dir, "eval", paths)


def plot_run(run_dir: Path | str, out_dir: Path | None = None) -> dict[str, Path]:
    """Draw a run's PNGs (default into run_dir/plots/) from its metrics.jsonl; returns
    {name: path} for those drawn: reward, sft_loss, pass_rate_by_domain, staleness, time_split,
    throughput, mismatch, eval. A plot whose metrics are absent (or never finite) is skipped."""
    run_dir = Path(run_dir)
    flat = _flat_all(read_metrics(run_dir))
    out_dir = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    paths: dict[str, Path] = {}
    if not flat:
        return paths
    out_dir.mkdir(parents=True, exist_ok=True)
    for plot in (_plot_reward, _plot_sft, _plot_domains, _plot_staleness, _plot_time_split,
                 _plot_throughput, _plot_mismatch, _plot_eval):
        plot(flat, out_dir, paths)
    return paths
