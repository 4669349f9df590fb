"""Quality checks of a task: its oracle solution passes (every one of `runs` fresh
environments), the untouched environment fails, and how long each part takes.

A task that fails a check is left out of evaluation and training sets: `load_tasks(...,
only_valid=True)` keeps only tasks whose check passed. Results are cached as JSON under
`$RIDGELINE_CACHE_DIR/task-checks/` (default `~/.cache/ridgeline/task-checks/`), keyed
by a hash of every file of the task plus the harness version, so editing a task (or
the harness) invalidates its cached result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from ridgeline.tasks.environment import TaskSandbox, TaskUnsupported, prepare_environment
from ridgeline.tasks.loader import BrokenTask
from ridgeline.tasks.model import Task
from ridgeline.tasks.solution import apply_solution
from ridgeline.tasks.steps import run_steps
from ridgeline.tasks.verifier import Verdict, VerdictStatus, verdict_from_error

log = logging.getLogger(__name__)

# Bump when a harness change can turn a cached verdict stale.
CHECK_VERSION = "1"


@dataclass
class TaskCheck:
    task_id: str
    path: str
    ok: bool
    reasons: list[str] = field(default_factory=list)
    unsupported: bool = False
    null: Verdict | None = None
    broken: bool = False        # the task directory does not load (never cached)
    oracle: list[Verdict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    task_hash: str = ""
    checked_at: float = 0.0

    @property
    def oracle_passes(self) -> int:
        return sum(v.passed for v in self.oracle)

    @property
    def flaky(self) -> bool:
        """The oracle's verdicts differ between fresh environments."""
        return 0 < self.oracle_passes < len(self.oracle)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["null"] = self.null.to_dict() if self.null else None
        d["oracle"] = [v.to_dict() for v in self.oracle]
        d["oracle_passes"] = self.oracle_passes
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TaskCheck":
        d = {k: v for k, v in d.items() if k != "oracle_passes"}
        d["null"] = Verdict.from_dict(d["null"]) if d.get("null") else None
        d["oracle"] = [Verdict.from_dict(v) for v in d.get("oracle", [])]
        return cls(**d)


def task_hash(task: Task) -> str:
    """Hash of every file in the task directory (path, exec bit, bytes; a symlink by its
    target text) and the harness. Links are never followed: the task is untrusted and a
    link to /dev/zero or a host secret must not be read."""
    h = hashlib.sha256(f"ridgeline-task-check/{CHECK_VERSION}".encode())
    here = Path(__file__).resolve().parent
    for name in ("offline_tools.py", "verifier.py", "environment.py", "dockerfile.py"):
        h.update((here / name).read_bytes())
    for p in _task_files(task.path):
        h.update(str(p.relative_to(task.path)).encode() + b"\0")
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            h.update(b"l" + os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(b"x" if st.st_mode & 0o111 else b"-")
            h.update(p.read_bytes())
    return h.hexdigest()


def _task_files(root: Path) -> list[Path]:
    """Regular files and symlinks under `root`, sorted, without descending into links."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        dirnames[:] = [n for n in dirnames if n != "__pycache__"]
        # os.walk lists a symlink to a directory among the directories: keep it as a link
        out += [base / n for n in dirnames if (base / n).is_symlink()]
        out += [base / n for n in filenames]
    return sorted(out)


def cache_dir() -> Path:
    base = os.environ.get("RIDGELINE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ridgeline")
    return Path(base) / "task-checks"


def cached_check(task: Task) -> TaskCheck | None:
    p = cache_dir() / f"{task_hash(task)}.json"
    try:
        return TaskCheck.from_dict(json.loads(p.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _save(check: TaskCheck) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{check.task_hash}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(check.to_dict(), indent=1))
        tmp.replace(d / f"{check.task_hash}.json")
    except OSError as e:  # a cache we cannot write only costs a re-check, but say why
        log.warning("could not cache the check of %s in %s: %s", check.task_id, d, e)


def _episode(task: Task, backend: str, oracle: bool) -> tuple[Verdict, dict[str, float], str]:
    """One fresh environment: optional oracle, then the verifier."""
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    note = ""
    try:
        with prepare_environment(task, backend) as sb:
            times["setup_s"] = time.perf_counter() - t0

            def act(view: Task, box: TaskSandbox) -> None:   # each step's oracle in turn
                nonlocal note
                if not oracle:
                    return
                t1 = time.perf_counter()
                res = apply_solution(view, box)
                times["oracle_s"] = times.get("oracle_s", 0.0) + time.perf_counter() - t1
                if not res.ok and not note:
                    note = (f"oracle solution exited with {res.exit_code}"
                            + (" (timed out)" if res.timed_out else ""))

            verdict = run_steps(task, sb, act)
            times["verify_s"] = verdict.duration_s
    except Exception as e:     # every failure becomes a verdict, never a crash
        verdict = verdict_from_error(e, time.perf_counter() - t0)
    return verdict, times, note


def check_task(task: Task, runs: int = 3, backend: str = "bwrap", *,
               save: bool = True) -> TaskCheck:
    """Oracle passes `runs`/`runs`, untouched environment fails; timings (medians)."""
    t0 = time.perf_counter()
    check = TaskCheck(task.id, str(task.path), ok=False, task_hash=task_hash(task),
                      checked_at=time.time())
    if (reason := task.unsupported_reason) is not None:
        check.unsupported = True
        check.reasons.append(f"unsupported: {reason}")
        return check
    if not task.has_solution:
        check.reasons.append("no oracle solution (solution.sh, solution.yaml or "
                             "solution/solve.sh)")
    samples: dict[str, list[float]] = {}
    null, times, _ = _episode(task, backend, oracle=False)
    check.null = null
    for k, v in times.items():
        samples.setdefault(k, []).append(v)
    if null.status is VerdictStatus.PASSED:
        check.reasons.append("the untouched environment already passes the tests")
    elif null.status is VerdictStatus.UNSUPPORTED:
        check.unsupported = True
        check.reasons.append(f"unsupported: {null.detail}")
    elif null.status is not VerdictStatus.FAILED:
        check.reasons.append(f"untouched environment: {null.status.value} "
                             f"({null.reason}): {null.detail}")
    if task.has_solution and not check.unsupported:
        for i in range(runs):
            verdict, times, note = _episode(task, backend, oracle=True)
            check.oracle.append(verdict)
            for k, v in times.items():
                samples.setdefault(k, []).append(v)
            if verdict.status is VerdictStatus.UNSUPPORTED:
                check.unsupported = True
                check.reasons.append(f"unsupported: {verdict.detail}")
                break
            if not verdict.passed:
                check.reasons.append(f"oracle run {i + 1}/{runs}: {verdict.status.value}"
                                     f" ({verdict.reason}): {verdict.detail}"
                                     + (f"; {note}" if note else ""))
    if check.flaky:
        check.reasons.insert(0, f"flaky: the oracle passed {check.oracle_passes} of "
                                f"{len(check.oracle)} runs")
    check.timings = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    check.timings["total_s"] = round(time.perf_counter() - t0, 3)
    check.ok = not check.reasons and check.oracle_passes == runs
    if save:
        _save(check)
    return check


def broken_check(task: BrokenTask) -> TaskCheck:
    """The check of a task directory that does not load: failed, with the reason."""
    return TaskCheck(task.id, str(task.path), ok=False, reasons=[f"broken: {task.reason}"],
                     broken=True, checked_at=time.time())


def check_tasks(tasks: Iterable[Task], runs: int = 3, backend: str = "bwrap",
                concurrency: int = 4,
                on_done: Callable[[TaskCheck], None] | None = None) -> list[TaskCheck]:
    """Check many tasks in parallel sandboxes; results in the order of `tasks`."""
    tasks = list(tasks)

    def one(task: Task) -> TaskCheck:
        c = check_task(task, runs, backend)
        if on_done is not None:
            on_done(c)
        return c

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, tasks))


def valid_tasks(tasks: list[Task], backend: str = "bwrap", concurrency: int = 4
                ) -> list[Task]:
    """The tasks whose (cached, or now computed) quality check passed."""
    results: dict[str, TaskCheck] = {}
    unchecked = []
    for t in tasks:
        c = cached_check(t)
        if c is None:
            unchecked.append(t)
        else:
            results[str(t.path)] = c
    for c in check_tasks(unchecked, backend=backend, concurrency=concurrency):
        results[c.path] = c
    return [t for t in tasks if results[str(t.path)].ok]


__all__ = ["CHECK_VERSION", "TaskCheck", "TaskUnsupported", "broken_check", "cache_dir",
           "cached_check", "check_task", "check_tasks", "task_hash", "valid_tasks"]
