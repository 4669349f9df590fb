"""Terminal-Bench tasks written by others, run as written, by the oracle and null agents.

A folder of task folders in either layout (Terminal-Bench v1 `task.yaml`, Harbor
`task.toml`); each episode goes through `ridgeline eval`'s own code (`run_episode`,
`run_episodes`); the result is a per-task table of outcomes.

    .venv/bin/python benchmarks/external_tasks.py --tasks /work/external-tasks \\
        --classification /work/external-tasks/classification.json \\
        --agents oracle null --concurrency 2 --json > result.json

    RIDGELINE_TASK_ENV=host|image|auto  selects how Dockerfiles become environments
                                        (passed through; recorded as `task_env`)

Task folders are found recursively under --tasks (a folder holding task.yaml or task.toml
is a task; nothing inside it is searched). A task that does not load is reported
(`unsupported`, reason `load_error: ...`) and the others still run. --classification is
a JSON object {task path relative to --tasks (or to the file's folder): {"eligible":
bool, "reason": str, "collection": str, "layout": "tb1"|"harbor"}}: whether the task's
build needs only Debian/PyPI packages and its own files (judged by reading the task,
never by running it), so the oracle's pass rate is reported over all tasks and over the
eligible ones side by side.

Prints one JSON object: `tasks` (per task: layout, collection, eligibility, and per agent
status passed|failed|unsupported|infra_error with its reason), `totals` per agent (pass
rate over all tasks, over scored tasks, over eligible tasks, counts by status, the
unsupported and failure reasons with their counts), `by_collection`, the environment
mode, the Ridgeline source it ran and the machine. Goal (issue 28): the oracle passes
>= 90% of the eligible tasks, the null agent none.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_common import machine, progress_log  # first, as in every benchmark

import ridgeline
from ridgeline.eval.runner import EvalConfig, run_episode, run_episodes, run_meta
from ridgeline.tasks import Task, load_task

STATUSES = ("passed", "failed", "unsupported", "infra_error")
TASK_FILES = ("task.yaml", "task.toml")
ENV_MODE = "RIDGELINE_TASK_ENV"


def find_task_dirs(root: Path) -> list[Path]:
    """Every folder under `root` (itself included) holding task.yaml or task.toml, sorted;
    a task's own folder is not searched further (tasks carry nested copies sometimes)."""
    found: list[Path] = []

    def walk(d: Path) -> None:
        if any((d / f).is_file() for f in TASK_FILES):
            found.append(d)
            return
        for sub in sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink()):
            if not sub.name.startswith((".", "_")):
                walk(sub)

    walk(root)
    return found


def task_key(root: Path, d: Path) -> str:
    return d.relative_to(root).as_posix() if d != root else d.name


def load_classification(path: Path | None, root: Path) -> dict[str, dict[str, Any]]:
    """The classification keyed by task path relative to `root` (keys relative to the
    file's own folder are re-based when that folder is an ancestor of `root`, or under it)."""
    if path is None:
        return {}
    raw = json.loads(path.read_text())
    base = path.resolve().parent
    out: dict[str, dict[str, Any]] = {}
    for key, value in raw.items():
        full = (base / key).resolve()
        try:
            out[full.relative_to(root.resolve()).as_posix()] = value
        except ValueError:
            out[key] = value
    return out


def layout_of(d: Path) -> str:
    return "harbor" if (d / "task.toml").is_file() or (d / "instruction.md").is_file() else "tb1"


def unique_id(key: str) -> str:
    """A task id from its relative path: task folder names repeat across collections,
    and the id names trajectory files."""
    return re.sub(r"[^A-Za-z0-9._-]+", "__", key)


def environment_record() -> dict[str, Any]:
    """The environment mode asked for (RIDGELINE_TASK_ENV, default auto) and, where this
    Ridgeline has image builds, the mode it resolves to."""
    asked = os.environ.get(ENV_MODE, "auto")
    rec: dict[str, Any] = {"task_env": asked, "resolved": None, "image_builds_in_source": False}
    try:
        # the image-build mode (issue 28), where this Ridgeline has it
        from ridgeline.tasks import images
    except ImportError:
        rec["resolved"] = "host"   # a Ridgeline without image builds: host-root mode only
        return rec
    rec["image_builds_in_source"] = True
    try:
        rec["resolved"] = "image" if images.uses_images() else "host"
        if asked == "auto" and rec["resolved"] == "host":
            rec["image_unavailable_reason"] = images.builder().unavailable_reason()
    except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
        rec["resolved_error"] = f"{type(e).__name__}: {e}"
    return rec


def source_record() -> dict[str, Any]:
    """Which Ridgeline ran: its source folder and, in a git checkout, the commit and
    whether src/ has uncommitted changes."""
    src = Path(ridgeline.__file__).resolve().parent
    rec: dict[str, Any] = {"path": str(src), "version": getattr(ridgeline, "__version__", None)}
    try:
        top = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        rec["commit"] = subprocess.run(["git", "-C", top, "rev-parse", "HEAD"], capture_output=True,
                                       text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", top, "status", "--porcelain", "--", str(src)],
                               capture_output=True, text=True, timeout=30, check=False).stdout.splitlines()
        rec["src_uncommitted_files"] = len(dirty)
    except (OSError, subprocess.SubprocessError):
        rec["commit"] = None
    return rec


def _reason_key(status: str, failure_class: str | None, detail: str) -> str:
    """A reason to count across tasks: the failure class, and for unsupported / infra
    results the first line of the detail with task-specific numbers and quoted names
    blurred."""
    first = (detail or "").strip().splitlines()[0] if (detail or "").strip() else ""
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", first)
    first = re.sub(r"\bline \d+", "line N", first)[:120]
    if status == "unsupported":
        return f"unsupported: {first}" if first else (failure_class or "unsupported")
    if status == "infra_error":
        return f"{failure_class or 'infra'}: {first}" if first else (failure_class or "infra")
    return failure_class or status


def outcome(res: Any) -> dict[str, Any]:
    """One episode's outcome for the table (and any environment-mode field it carries)."""
    d = res.model_dump()
    out = {"status": res.status.value, "reason": res.failure_class,
           "detail": (res.detail or "")[:400], "tests_passed": res.tests_passed,
           "tests_total": res.tests_total, "steps": res.steps, "wall_s": round(res.wall_s, 2)}
    for k in ("env_mode", "environment_mode", "task_env", "image"):
        if d.get(k) is not None:
            out[k] = d[k]
    return out


def rate(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def totals(rows: list[dict[str, Any]], agent: str) -> dict[str, Any]:
    """An agent's totals over `rows` (the per-task table)."""
    outs = [r["agents"][agent] for r in rows if agent in r["agents"]]
    counts = Counter(o["status"] for o in outs)
    passed = counts["passed"]
    scored = counts["passed"] + counts["failed"]
    eligible = [r["agents"][agent] for r in rows if r.get("eligible") and agent in r["agents"]]
    e_counts = Counter(o["status"] for o in eligible)
    reasons = Counter(_reason_key(o["status"], o["reason"], o["detail"])
                      for o in outs if o["status"] != "passed")
    return {
        "n_tasks": len(outs),
        **{f"n_{s}": counts[s] for s in STATUSES},
        "pass_rate_all": rate(passed, len(outs)),
        "pass_rate_scored": rate(passed, scored),
        "n_eligible": len(eligible),
        "eligible": {f"n_{s}": e_counts[s] for s in STATUSES},
        "pass_rate_eligible": rate(e_counts["passed"], len(eligible)),
        "unsupported_reasons": dict(Counter(
            _reason_key("unsupported", o["reason"], o["detail"])
            for o in outs if o["status"] == "unsupported").most_common()),
        "not_passed_reasons": dict(reasons.most_common()),
    }


def goal_met(t: dict[str, dict[str, Any]]) -> bool:
    """Issue 28's goal: the oracle passes >= 90% of the eligible tasks, the null agent none."""
    return (t["oracle"]["pass_rate_eligible"] or 0.0) >= 0.9 and t["null"]["n_passed"] == 0


def markdown_table(paths: list[Path]) -> str:
    """One row per task: its collection, layout and eligibility, then each run's oracle
    and null outcome (a failure's reason shortened)."""
    runs = [json.loads(p.read_text()) for p in paths]
    heads = [f"{r.get('environment', {}).get('resolved') or r.get('task_env', '?')}"
             for r in runs]
    lines = ["| task | layout | eligible | " + " | ".join(
        f"oracle ({h}) | null ({h})" for h in heads) + " |",
        "|---|---|---|" + "---|---|" * len(runs)]

    def cell(out: dict | None) -> str:
        if out is None:
            return "-"
        status = out.get("status", "?")
        if status == "passed":
            return "passed"
        why = (out.get("detail") or out.get("reason") or "").replace("|", "/")
        return f"{status}: {why[:70]}"
    for row in runs[-1]["tasks"]:
        others = [{t["task"]: t for t in r["tasks"]}.get(row["task"]) for r in runs]
        cols = []
        for o in others:
            agents = (o or {}).get("agents", {})
            cols += [cell(agents.get("oracle")), cell(agents.get("null"))]
        lines.append(f"| {row['task']} | {row['layout']} | "
                     f"{'yes' if row.get('eligible') else 'no'} | " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tasks", type=Path, required=True,
                    help="a folder of task folders (searched recursively)")
    ap.add_argument("--classification", type=Path, default=None,
                    help="JSON {task path: {eligible, reason, collection, layout}}")
    ap.add_argument("--agents", nargs="+", default=["oracle", "null"], choices=["oracle", "null"])
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--backend", default="bwrap", help="sandbox backend: bwrap | local | docker")
    ap.add_argument("--only", nargs="*", default=[],
                    help="only task paths starting with one of these (relative to --tasks)")
    ap.add_argument("--only-eligible", action="store_true", help="only tasks classified eligible")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the eval runs write results/trajectories (default runs/external-...)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON object here")
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--markdown", nargs="+", type=Path, metavar="RESULT.json",
                    help="print the per-task table of these result files (columns in "
                         "order, e.g. a host-mode run then an image-mode run) and exit")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(args.markdown))
        return 0
    log = progress_log(args.json)

    root = args.tasks.expanduser().resolve()
    if not root.is_dir():
        ap.error(f"--tasks {root}: not a folder")
    classification = load_classification(args.classification, root)
    dirs = find_task_dirs(root)
    if args.only:
        dirs = [d for d in dirs if any(task_key(root, d).startswith(p) for p in args.only)]
    if args.only_eligible:
        dirs = [d for d in dirs if classification.get(task_key(root, d), {}).get("eligible")]
    if not dirs:
        ap.error(f"no task folders (task.yaml / task.toml) under {root}")

    rows: dict[str, dict[str, Any]] = {}
    tasks: list[Task] = []
    by_id: dict[str, str] = {}
    for d in dirs:
        key = task_key(root, d)
        cls = classification.get(key, {})
        row: dict[str, Any] = {
            "task": key, "layout": cls.get("layout") or layout_of(d),
            "collection": cls.get("collection") or key.split("/")[0],
            "eligible": cls.get("eligible"), "eligibility_reason": cls.get("reason"),
            "loaded": True, "agents": {}}
        try:
            task = load_task(d)
        except Exception as e:  # noqa: BLE001  (one broken task never stops the rest)
            row["loaded"] = False
            msg = f"{type(e).__name__}: {e}"
            hint = getattr(e, "hint", None)
            load_out = {"status": "unsupported", "reason": "load_error",
                        "detail": (msg + (f" (hint: {hint})" if hint else ""))[:400],
                        "tests_passed": 0, "tests_total": 0, "steps": 0, "wall_s": 0.0}
            row["agents"] = {a: dict(load_out) for a in args.agents}
        else:
            tid = unique_id(key)
            row["has_solution"] = bool(getattr(task, "has_solution", True))
            tasks.append(dataclasses.replace(task, id=tid))
            by_id[tid] = key
        rows[key] = row
    unknown = [k for k in rows if k not in classification]
    log(f"{len(rows)} task folders under {root}: {len(tasks)} loaded, "
        f"{len(rows) - len(tasks)} did not load"
        + (f"; {len(unknown)} not in the classification" if classification and unknown else ""))

    env = environment_record()
    log(f"environment mode: {ENV_MODE}={env['task_env']} (resolved: {env['resolved']})")
    out_dir = args.out_dir or Path("runs") / f"external-{datetime.now():%Y%m%d-%H%M%S}"
    runs: dict[str, Any] = {}
    t_all = time.perf_counter()
    for agent in args.agents:
        config = EvalConfig(tasks=str(root), agent=agent, concurrency=args.concurrency,
                            out=out_dir / agent, backend=args.backend)
        traj_dir = config.out_dir() / "trajectories"
        traj_dir.mkdir(parents=True, exist_ok=True)
        done = 0

        def on_result(res: Any, agent: str = agent) -> None:
            nonlocal done
            done += 1
            log(f"  [{agent} {done}/{len(tasks)}] {by_id.get(res.task_id, res.task_id)}: "
                f"{res.status.value} {res.failure_class or ''}")

        log(f"{agent}: {len(tasks)} tasks, concurrency {args.concurrency}")
        t0 = time.perf_counter()
        run = run_episodes(config, tasks,
                           lambda task, sample, c=config, a=agent, td=traj_dir:
                           run_episode(task, sample, lambda: a, c, td)[0],
                           config.out_dir(), run_meta(config, "-"), on_result=on_result)
        for res in run.results:
            rows[by_id[res.task_id]]["agents"][agent] = outcome(res)
        runs[agent] = {"wall_s": round(time.perf_counter() - t0, 1),
                       "results": str(run.files.get("results", "")),
                       "eval_summary": run.summary.model_dump()}

    table = [rows[k] for k in sorted(rows)]
    by_collection: dict[str, dict[str, Any]] = defaultdict(dict)
    for coll in sorted({r["collection"] for r in table}):
        sub = [r for r in table if r["collection"] == coll]
        by_collection[coll] = {"n_tasks": len(sub), "n_eligible": sum(bool(r["eligible"]) for r in sub),
                               **{f"{a}_passed": sum(r["agents"].get(a, {}).get("status") == "passed"
                                                     for r in sub) for a in args.agents}}
    by_layout = {lay: {"n_tasks": sum(r["layout"] == lay for r in table),
                       "n_eligible": sum(r["layout"] == lay and bool(r["eligible"]) for r in table),
                       **{f"{a}_passed": sum(r["layout"] == lay and r["agents"].get(a, {}).get("status") == "passed"
                                             for r in table) for a in args.agents}}
                 for lay in sorted({r["layout"] for r in table})}
    result_totals = {a: totals(table, a) for a in args.agents}
    result = {
        "benchmark": "external_tasks",
        "tasks_root": str(root),
        "classification": str(args.classification) if args.classification else None,
        "task_env": env["task_env"],
        "environment": env,
        "ridgeline_source": source_record(),
        "agents": args.agents,
        "concurrency": args.concurrency,
        "backend": args.backend,
        "n_tasks": len(table),
        "n_loaded": len(tasks),
        "n_eligible": sum(bool(r["eligible"]) for r in table),
        "totals": result_totals,
        "by_layout": by_layout,
        "by_collection": dict(by_collection),
        "goal": "oracle pass_rate_eligible >= 0.9 and null n_passed == 0 (issue 28)",
        "goal_met": goal_met(result_totals) if {"oracle", "null"} <= set(args.agents) else None,
        "runs": runs,
        "wall_s": round(time.perf_counter() - t_all, 1),
        "tasks": table,
        "machine": machine(),
    }
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
    else:
        for r in table:
            cells = "  ".join(f"{a}={r['agents'].get(a, {}).get('status', '-'):<11}" for a in args.agents)
            print(f"{'E' if r['eligible'] else ' '} {r['task'][:70]:<70} {cells}")
        for a in args.agents:
            t = result["totals"][a]
            print(f"{a}: all {t['n_passed']}/{t['n_tasks']}, eligible {t['eligible']['n_passed']}/"
                  f"{t['n_eligible']}, unsupported {t['n_unsupported']}, infra {t['n_infra_error']}")
        print(f"task_env={env['task_env']} (resolved {env['resolved']})  machine: {result['machine']['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
