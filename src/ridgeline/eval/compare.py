"""Two or more evaluation runs side by side: `ridgeline eval-compare RUN_DIR RUN_DIR...`.

Each run directory is what `ridgeline eval` wrote (results.json). The comparison is per
task (passed / scored episodes in each run) and overall (pass@1 with its 95% interval),
and it says whether the runs are comparable: the same tasks, and the same sampling
(temperature, top-p, max tokens, samples per task). Runs that differ in either are still
shown, with the difference named, because a pass rate under other sampling is another
measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer

from ridgeline.errors import ConfigError
from ridgeline.tasks.verifier import VerdictStatus

#: The meta fields two runs must share to be compared as the same measurement.
SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "samples")


@dataclass
class RunColumn:
    label: str
    model: str
    pass_rate: float
    ci95: tuple[float, float] | None
    passed: int
    scored: int
    infra_errors: int
    per_task: dict[str, tuple[int, int]]   # task -> (passed, scored)
    meta: dict[str, Any]


@dataclass
class Comparison:
    runs: list[RunColumn]
    tasks: list[str]
    differences: list[str] = field(default_factory=list)   # why they are not comparable

    def to_json(self) -> dict[str, Any]:
        return {"runs": [{"label": r.label, "model": r.model, "pass_rate": r.pass_rate,
                          "pass_at_1_ci95": r.ci95, "passed": r.passed, "scored": r.scored,
                          "infra_errors": r.infra_errors,
                          "per_task": {t: list(v) for t, v in r.per_task.items()}}
                         for r in self.runs],
                "comparable": not self.differences, "differences": self.differences}


def load_run(path: Path, label: str | None = None) -> RunColumn:
    results = path / "results.json"
    if not results.is_file():
        raise ConfigError(f"{path} holds no results.json",
                          hint="pass directories `ridgeline eval --out DIR` wrote")
    try:
        data = json.loads(results.read_text())
        meta, summary, episodes = data["meta"], data["summary"], data["episodes"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{results} is not an evaluation's results ({e})",
                          hint="pass directories `ridgeline eval --out DIR` wrote") from None
    per_task: dict[str, tuple[int, int]] = {}
    for ep in episodes:
        p, s = per_task.get(ep["task_id"], (0, 0))
        status = VerdictStatus(ep["status"])
        per_task[ep["task_id"]] = (p + (status is VerdictStatus.PASSED), s + status.scored)
    ci = summary.get("pass_at_1_ci95")
    return RunColumn(label or path.name, str(meta.get("model", "?")), float(summary["pass_rate"]),
                     tuple(ci) if ci else None, int(summary["n_passed"]),
                     int(summary["n_scored"]), int(summary.get("n_infra_error", 0)),
                     per_task, meta)


def compare(paths: list[Path], labels: list[str] | None = None) -> Comparison:
    if len(paths) < 2:
        raise ConfigError("compare needs at least two evaluation runs",
                          hint="ridgeline eval-compare runs/demo runs/demo-trained")
    if labels and len(labels) != len(paths):
        raise ConfigError(f"{len(labels)} labels for {len(paths)} runs",
                          hint="give one --label per run, or none")
    runs = [load_run(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    tasks = sorted(set().union(*(r.per_task for r in runs)))
    differences = []
    first = runs[0]
    for r in runs[1:]:
        for key in SAMPLING_KEYS:
            if first.meta.get(key) != r.meta.get(key):
                differences.append(f"{key}: {first.label} {first.meta.get(key)} vs "
                                   f"{r.label} {r.meta.get(key)}")
        if set(r.per_task) != set(first.per_task):
            differences.append(f"tasks: {first.label} and {r.label} ran different tasks")
    return Comparison(runs, tasks, differences)


def compare_command(
    runs: list[Path] = typer.Argument(..., help="Evaluation run directories (results.json)."),
    label: list[str] = typer.Option([], "--label", help="A name per run (default: the directory name)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Evaluation runs side by side: per task and overall, with whether they are comparable."""
    from rich.console import Console
    from rich.table import Table

    cmp = compare(runs, label or None)
    if as_json:
        typer.echo(json.dumps(cmp.to_json()))
        return
    console = Console()
    table = Table(title="pass / scored episodes per task")
    table.add_column("task")
    for r in cmp.runs:
        table.add_column(r.label, justify="right")
    for t in cmp.tasks:
        table.add_row(t, *(f"{r.per_task[t][0]}/{r.per_task[t][1]}" if t in r.per_task
                          else "-" for r in cmp.runs))
    table.add_row("[bold]all[/]", *(f"[bold]{r.passed}/{r.scored}[/]" for r in cmp.runs))
    console.print(table)
    for r in cmp.runs:
        ci = (f", 95% interval {100 * r.ci95[0]:.1f}-{100 * r.ci95[1]:.1f}%"
              if r.ci95 else "")
        console.print(f"{r.label} ({r.model}): pass@1 {100 * r.pass_rate:.1f}%{ci}"
                      + (f"; {r.infra_errors} infrastructure errors" if r.infra_errors else ""))
    if cmp.differences:
        console.print("[yellow]not the same measurement:[/] " + "; ".join(cmp.differences))
