"""`ridgeline tasks list|check|images|families|generate`: see what a task directory holds,
quality-check it, build its images, and generate tasks from the built-in families."""

from __future__ import annotations

import json
import sys
from typing import Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ridgeline.errors import ConfigError
from ridgeline.tasks.checks import TaskCheck, broken_check, check_tasks
from ridgeline.tasks.loader import BrokenTask, load_suite

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Terminal tasks (Terminal-Bench v1 and Harbor layouts).")
console = Console()


@app.command("list")
def list_tasks(
    directory: str = typer.Argument("builtin", help="a task, a directory of tasks, or "
                                    "'builtin'"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """List tasks: id, domain, difficulty. A task directory that does not load is listed
    as broken, with the reason; the others are listed all the same."""
    suite = load_suite(directory)
    tasks = suite.tasks
    if as_json:
        rows = [{"id": t.id, "domain": t.domain, "difficulty": t.difficulty,
                 "layout": t.layout.value, "tags": list(t.tags), "path": str(t.path),
                 "broken": False} for t in tasks]
        rows += [{**b.to_dict(), "broken": True} for b in suite.broken]
        print(json.dumps(sorted(rows, key=lambda r: r["id"]), indent=1))
        return
    title = f"{len(tasks)} tasks" + (f", {len(suite.broken)} broken" if suite.broken else "")
    table = Table(title=title)
    for col in ("id", "domain", "difficulty", "layout"):
        table.add_column(col)
    for t in tasks:
        table.add_row(t.id, t.domain, t.difficulty, t.layout.value)
    for b in suite.broken:
        table.add_row(b.id, "-", "-", "[red]broken[/]")
    console.print(table)
    _print_broken(suite.broken)


def _print_broken(broken: list[BrokenTask]) -> None:
    for b in broken:        # reasons are long: one line each, below the table
        console.print(f"[red]broken[/] {b.id}: {b.reason}", highlight=False, soft_wrap=True)


def _summary(c: TaskCheck, runs: int) -> dict:
    return {"id": c.task_id, "ok": c.ok, "unsupported": c.unsupported,
            "broken": c.broken, "reasons": c.reasons, "oracle_passes": c.oracle_passes,
            "runs": runs,
            "null_status": c.null.status.value if c.null else None,
            "timings": c.timings, "path": c.path}


@app.command("check")
def check(
    directory: str = typer.Argument(..., help="a task directory or a suite of tasks "
                                    "('builtin' for the built-in suite)"),
    runs: int = typer.Option(3, "--runs", min=1, help="oracle runs that must all pass"),
    concurrency: int = typer.Option(4, "--concurrency", "-j", min=1,
                                    help="tasks checked at once"),
    backend: str = typer.Option("bwrap", "--backend", help="sandbox backend"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Quality-check tasks: the oracle passes RUNS/RUNS, the untouched environment fails.
    Failing tasks are flagged with the reason (exit code 1 if any); so are unsupported
    tasks and task directories that do not load (broken), each with its reason, and
    the others are checked all the same."""
    suite = load_suite(directory)
    tasks = suite.tasks
    progress = Progress(TextColumn("[bold]checking"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"),
                        console=Console(stderr=True), disable=as_json or not sys.stderr.isatty())
    with progress:
        bar = progress.add_task("", total=len(tasks))

        def done(c: TaskCheck) -> None:
            progress.update(bar, advance=1, description=c.task_id)

        checks = check_tasks(tasks, runs=runs, backend=backend, concurrency=concurrency,
                             on_done=done)
    checks = sorted(checks + [broken_check(b) for b in suite.broken],
                    key=lambda c: c.task_id)
    n_ok = sum(c.ok for c in checks)
    if as_json:
        print(json.dumps({"n_tasks": len(checks), "n_valid": n_ok,
                          "n_invalid": len(checks) - n_ok,
                          "n_unsupported": sum(c.unsupported for c in checks),
                          "n_broken": sum(c.broken for c in checks),
                          "tasks": [_summary(c, runs) for c in checks]}, indent=1))
    else:
        table = Table(title=f"{n_ok}/{len(checks)} tasks pass the quality checks")
        for col in ("id", "ok", "oracle", "null", "setup s", "oracle s", "verify s"):
            table.add_column(col, overflow="fold")
        for c in checks:
            t = c.timings
            table.add_row(
                c.task_id, "[green]yes[/]" if c.ok else "[red]broken[/]" if c.broken
                else "[yellow]unsupported[/]" if c.unsupported else "[red]NO[/]",
                f"{c.oracle_passes}/{runs}", c.null.status.value if c.null else "-",
                f"{t.get('setup_s', 0):.2f}", f"{t.get('oracle_s', 0):.2f}",
                f"{t.get('verify_s', 0):.2f}")
        console.print(table)
        for c in checks:        # reasons are long: one line each, below the table
            for reason in c.reasons:
                console.print(f"[red]NO[/] {c.task_id}: {reason}", highlight=False,
                              soft_wrap=True)
    if n_ok < len(checks):
        raise typer.Exit(1)


@app.command("images")
def images(
    directory: str = typer.Argument("", help="also build the images of these tasks (a "
                                    "task or a directory of tasks)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Build the local base images task Dockerfiles are mapped onto (once per machine;
    `make install` runs this), and optionally every task's own image. Exit code 1 if a
    base image cannot be built; a task that cannot be built is reported, not fatal."""
    import time

    from ridgeline.tasks.images import PREPARED_BASES, BuildRefused, builder
    b = builder()
    if (why := b.unavailable_reason()) is not None:
        console.print(f"[red]task images cannot be built here:[/red] {why}")
        raise typer.Exit(1)
    rows: list[dict] = []
    for ref in PREPARED_BASES:
        t0 = time.perf_counter()
        rows.append({"image": ref, "id": b.ensure_base(ref)[:12],
                     "seconds": round(time.perf_counter() - t0, 1), "status": "ready"})
    if directory:
        suite = load_suite(directory)
        for task in suite.tasks:
            if task.build.source is None:
                continue
            row = {"image": task.id, "id": "", "seconds": 0.0, "status": ""}
            try:
                img = b.build(task.build.source, task.build.context)
                row.update(id=img.image_id[:12], seconds=round(img.build_s, 1),
                           status="cached" if img.cached else "built")
            except BuildRefused as e:
                row["status"] = f"unsupported: {e}"
            except Exception as e:  # noqa: BLE001 - one task never stops the rest
                row["status"] = f"failed: {e}"
            rows.append(row)
        rows += [{"image": str(bt.path), "id": "", "seconds": 0.0,
                  "status": f"broken: {bt.reason}"} for bt in suite.broken]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="task images")
    for col in ("image", "id", "seconds", "status"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["image"]), r["id"], f"{r['seconds']:.1f}", r["status"])
    console.print(table)


@app.command("families")
def list_families(
    split: str = typer.Option(None, "--split", help="train or heldout (default: both)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """List the built-in task families (generators of verifiable tasks)."""
    from ridgeline.tasks.families import families

    fams = families(_split(split))
    if as_json:
        print(json.dumps([{"name": f.name, "skill": f.skill, "split": f.split,
                           "description": f.description} for f in fams], indent=1))
        return
    table = Table(title=f"{len(fams)} task families")
    for col in ("name", "skill", "split", "what"):
        table.add_column(col)
    for f in fams:
        table.add_row(f.name, f.skill, f.split, f.description)
    console.print(table)


@app.command("generate")
def generate_tasks(
    out: str = typer.Argument(..., help="directory to write the task directories into"),
    family: list[str] = typer.Option(None, "--family", "-f",
                                     help="a family name (repeatable; default: all of --split)"),
    split: str = typer.Option(None, "--split", help="train or heldout (default: both)"),
    count: int = typer.Option(4, "--count", "-n", min=1, help="instances per family"),
    seed: int = typer.Option(0, "--seed", help="first seed; instances use seed..seed+count-1"),
    check: bool = typer.Option(True, "--check/--no-check",
                               help="quality-check each instance and leave out failures"),
    backend: str = typer.Option("bwrap", "--backend", help="sandbox backend for the check"),
) -> None:
    """Generate task instances from families as Terminal-Bench v1 task directories (each
    quality-checked: the oracle passes, the untouched workspace fails)."""
    from ridgeline.tasks.families import families, generate, get_family

    fams = [get_family(name) for name in family] if family else families(_split(split))
    result = generate(fams, range(seed, seed + count), out, check=check, backend=backend)
    console.print(f"{len(result.tasks)} tasks written to {out}"
                  + (f", {len(result.excluded)} left out" if result.excluded else ""))
    for task_id, reasons in result.excluded.items():
        for reason in reasons:
            console.print(f"[red]left out[/] {task_id}: {reason}", highlight=False,
                          soft_wrap=True)
    if result.excluded:
        raise typer.Exit(1)


def _split(split: str | None) -> Literal["train", "heldout"] | None:
    if split in (None, "train", "heldout"):
        return split  # type: ignore[return-value]
    raise ConfigError(f"--split must be train or heldout, not {split!r}",
                      hint="omit it for both")
