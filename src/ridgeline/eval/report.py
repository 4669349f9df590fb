"""Writes what an evaluation leaves behind: `results.json`, `report.md` and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ridgeline.agent.results import write_results
from ridgeline.eval.results import EpisodeResult, Summary
from ridgeline.tasks.verifier import VerdictStatus

__all__ = ["render_markdown", "write_plots", "write_report", "write_results"]


def write_plots(out_dir: Path, results: list[EpisodeResult], summary: Summary) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    domains = list(summary.by_domain)
    if domains:
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(domains)), 4))
        rates = [100 * summary.by_domain[d]["pass_rate"] for d in domains]
        bars = ax.bar(range(len(domains)), rates, color="#3b7dd8")
        for b, d in zip(bars, domains):
            info = summary.by_domain[d]
            ax.annotate(f"{int(info['passed'])}/{int(info['scored'])}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(domains)), domains, rotation=30, ha="right")
        ax.set_ylim(0, 105)
        ax.set_ylabel("pass rate (%) of scored episodes")
        ax.set_title("Pass rate by domain")
        fig.tight_layout()
        p = out_dir / "pass_rate_by_domain.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    if results:
        fig, ax = plt.subplots(figsize=(6, 4))
        passed = [r.steps for r in results if r.status is VerdictStatus.PASSED]
        other = [r.steps for r in results if r.status is not VerdictStatus.PASSED]
        top = max(r.steps for r in results)
        bins = range(0, max(top, 1) + 2)
        ax.hist([passed, other], bins=bins, stacked=True, label=["passed", "not passed"],
                color=["#2e9e5b", "#c9503c"])
        ax.set_xlabel("agent steps per episode")
        ax.set_ylabel("episodes")
        ax.set_title("Steps per episode")
        ax.legend()
        fig.tight_layout()
        p = out_dir / "steps_histogram.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def render_markdown(results: list[EpisodeResult], summary: Summary, meta: dict[str, Any],
                    plots: list[Path]) -> str:
    lines = [f"# Evaluation: {meta.get('agent', '?')} on {meta.get('tasks', '?')}", ""]
    lines.append(f"Model: `{meta.get('model', '-')}` · samples per task: {meta.get('samples', 1)} · "
                 f"concurrency: {meta.get('concurrency', 1)} · wall time: {summary.wall_s:.1f} s · "
                 f"date: {meta.get('date', '')}")
    if meta.get("task_environment"):
        lines.append(f"Tasks with a Dockerfile: {meta['task_environment']} (backend "
                     f"{meta.get('backend', '?')}); tasks without one run on the "
                     f"host's system directories with their files")
    if "temperature" in meta:
        lines.append(f"Sampling: temperature {meta['temperature']}, top_p {meta['top_p']}, "
                     f"seed {meta['seed']}, max_tokens {meta['max_tokens']}")
    n_broken = getattr(summary, "n_broken", 0)
    asked = summary.n_episodes + n_broken * int(meta.get("samples", 1) or 1)
    all_rate = getattr(summary, "pass_rate_all", summary.n_passed / asked if asked else 0.0)
    # the all-tasks figure first: a suite mostly unsupported never reads as 100% alone
    lines += ["", "## Summary", "",
              f"- **pass rate over all tasks: {100 * all_rate:.1f}%** ({summary.n_passed} of "
              f"{asked} episodes over {summary.n_tasks + n_broken} tasks; unsupported, "
              f"broken and infrastructure errors count as not passed)",
              f"- **pass rate: {100 * summary.pass_rate:.1f}%** of scored episodes, the "
              f"supported tasks ({summary.n_passed} of {summary.n_scored} scored episodes "
              f"over {summary.n_tasks} tasks)"]
    if summary.pass_at_1_ci95 is not None:
        lo, hi = summary.pass_at_1_ci95
        lines.append(f"- pass@1 95% interval: {100 * lo:.1f}-{100 * hi:.1f}% (bootstrap over "
                     "tasks)")
    for k, v in summary.pass_at_k.items():
        lines.append(f"- {k}: {100 * v:.1f}%")
    lines.append(f"- not scored: {summary.n_infra_error} infrastructure errors, "
                 f"{summary.n_unsupported} unsupported, {n_broken} broken tasks (these are "
                 f"never counted as failures of the agent)")
    lines.append(f"- mean steps {summary.mean_steps:.1f}, format errors per episode "
                 f"{summary.mean_format_errors:.2f}, total tokens {summary.total_tokens}")
    if summary.failure_classes:
        lines.append("- why episodes did not pass: " + ", ".join(
            f"{k} {v}" for k, v in summary.failure_classes.items()))
    lines += ["", "## By domain", "", "| domain | passed | scored | pass rate |", "|---|---:|---:|---:|"]
    for d, info in summary.by_domain.items():
        lines.append(f"| {d} | {int(info['passed'])} | {int(info['scored'])} | {100 * info['pass_rate']:.0f}% |")
    not_run = [(t, "unsupported", why) for t, why in
               getattr(summary, "unsupported_tasks", {}).items()]
    not_run += [(t, "broken", why) for t, why in getattr(summary, "broken_tasks", {}).items()]
    if not_run:
        lines += ["", "## Tasks that did not run", "", "| task | status | why |",
                  "|---|---|---|"]
        for task_id, status, why in sorted(not_run):
            lines.append(f"| {task_id} | {status} | {_cell(why)} |")
    for p in plots:
        lines += ["", f"![{p.stem}]({p.name})"]
    lines += ["", "## Episodes", "", "| task | sample | status | tests | steps | tokens | wall s | why |",
              "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in sorted(results, key=lambda r: (r.task_id, r.sample)):
        lines.append(f"| {r.task_id} | {r.sample} | {r.status.value} | {r.tests_passed}/{r.tests_total} | {r.steps} | "
                     f"{r.tokens} | {r.wall_s:.1f} | {r.failure_class or ''} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """`text` as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")[:300]


def write_report(out_dir: Path, results: list[EpisodeResult], summary: Summary,
                 meta: dict[str, Any]) -> dict[str, Path]:
    """Write results.json, the plots and report.md; returns their paths."""
    res = write_results(out_dir, results, summary, meta)
    plots = write_plots(out_dir, results, summary)
    md = out_dir / "report.md"
    md.write_text(render_markdown(results, summary, meta, plots))
    return {"results": res, "report": md, **{p.stem: p for p in plots}}
