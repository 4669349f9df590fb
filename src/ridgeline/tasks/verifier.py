"""The verifier: after the agent, copy the tests in, run the task's test script under its
timeout, and turn what happened into a `Verdict`.

Before anything is staged, every process in the sandbox is killed (the agent's
background jobs included), so nothing the agent left behind can swap, forge or race the
tests and their results. Harbor's `/logs/verifier` is then replaced by a fresh, empty
directory, and the reward is read by the host through directory descriptors that never
follow a link (`sandbox.hostfs`): a link the agent planted is an error, never a path.

Nothing the agent wrote runs or configures the verifier's tools: HOME (/root) is
emptied (the agent's files are moved out of the sandbox's view), /tmp is a new tmpfs,
user site-packages are off, and the offline tools never run pytest from a venv the
agent left (tasks/offline_tools.py).

The verdict comes from the test runner's own report (tasks/ridgeline_report.py), sent
over a socket only the runner holds, never from the text the tests print: a pytest
session that started and did not report its end (the code under test killed or
replaced its runner) is a failure. On Harbor tasks a reward of 1 must agree with that
report.

`passed`/`failed` are the agent's result. `infra_error` (sandbox crash, missing test
script, test timeout, no test results, missing reward file, a pytest that ran no test:
a usage error, an unloadable conftest or plugin, nothing collected, pytest missing) and
`unsupported` (the test script needs what this machine cannot provide) are not: their
`reward` is None, never 0, so they never become a training signal. A Harbor reward file
counts only when the tests ran: one a test.sh wrote after its pytest died of a usage
error is not read. The agent's workspace can stop pytest too (a `pytest.ini` or
`conftest.py` of its own where the tests are collected, a program that prints pytest's
errors): a run that ran no test stands as ours only if the same tests run no test in a
fresh environment of the task as well (a control, `verify`); else it is the agent's
failure. What the agent controls can never make one: the modes of its trees
are reset, its home replaced, and a workspace it filled past the task's disk quota, or
tests killed for a limit, are its failure. (Every pytest may write `--ctrf FILE`:
ridgeline_ctrf.py is loaded into each.)
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path  # noqa: F401 - annotations

from ridgeline.errors import RidgelineError, SandboxError, TaskError
from ridgeline.sandbox import hostfs
from ridgeline.tasks import artifacts
from ridgeline.tasks.environment import (
    HOME_PATH, LOGS_PATH, TESTS_PATH, EnvironmentSetupError, TaskSandbox, TaskUnsupported,
    prepare_environment, stage_copy,
)
from ridgeline.tasks.harness import HARNESS_MOUNT, OFFLINE_MARK
from ridgeline.tasks.model import Task, TaskLayout
from ridgeline.tasks.pytest_output import Outcome, TestResult, parse_pytest_output

OUTPUT_TAIL = 4000
#: A reward file is a number or a small JSON object; anything larger is not one.
MAX_REWARD_BYTES = 64 * 1024
#: What the host keeps of the runner's reports (a flood from elsewhere is drained).
MAX_REPORT_BYTES = 16 * 1024 * 1024
#: The workspace counts as full (the agent's doing) with less than this left.
FULL_SLACK_BYTES = 1024 * 1024
REPORT_FD_ENV = "RIDGELINE_REPORT_FD"
PYTEST_HEADER = "test session starts"
#: Plugins of the harness every pytest in a verification loads; ridgeline_ctrf serves
#: `--ctrf` when no real pytest-json-ctrf is there (it comes last, after the task's own).
HARNESS_PLUGINS = ("ridgeline_report", "ridgeline_ctrf")
#: pytest's exit codes of a run that ran no test through no doing of the code under test
#: (pytest.ExitCode); 2 (interrupted: what the tests imported may call pytest.exit) is
#: not one of them.
NO_RUN_EXITS = {3: ("pytest_internal_error", "pytest failed with an internal error"),
                4: ("pytest_usage_error", "pytest stopped on a usage error"),
                5: ("no_tests_collected", "pytest collected no tests")}
#: What pytest prints when it stops before running any test, and what it means; the
#: first pattern that matches names the reason (its line is the detail).
NO_RUN_LINES = [
    (re.compile(r"^(?:\S*/)?(?:pytest|py\.test|__main__\.py): error: .+$", re.M),
     "pytest_usage_error", "pytest stopped on a usage error"),
    (re.compile(r"ImportError while loading conftest .+$", re.M),
     "pytest_usage_error", "pytest could not load a conftest"),
    (re.compile(r"Error importing plugin .+$", re.M),
     "pytest_usage_error", "pytest could not load a plugin"),
    (re.compile(r"^ERROR: (?:file or directory not found|not found|module or package not "
                r"found): .+$", re.M),
     "pytest_usage_error", "pytest was given tests that do not exist"),
    (re.compile(r"^ERROR: usage: .+$", re.M),
     "pytest_usage_error", "pytest stopped on a usage error"),
    (re.compile(r"\b(?:pytest|py\.test|uvx?)(?:: line \d+)?: (?:command )?not found.*$|"
                r"No module named '?pytest'?$", re.M),
     "test_command_not_found", "the test runner is not installed"),
    (re.compile(r"^INTERNALERROR> .+$", re.M),
     "pytest_internal_error", "pytest failed with an internal error"),
    (re.compile(r"^=* ?no tests ran in [\d.]+s.*$", re.M),
     "no_tests_collected", "pytest collected no tests"),
]
#: The reasons of a verdict that says the tests' pytest ran no test (see `no_test_run`);
#: with "unsupported" (the offline tools could not provide what the tests need) these
#: are the verdicts a control run checks (`_checked_by_control`).
NO_RUN_REASONS = frozenset({r for r, _ in NO_RUN_EXITS.values()}
                           | {r for _, r, _ in NO_RUN_LINES}
                           # what a program of the agent's that the test script runs can
                           # also cause: a hang, a flood of output, a missing or garbled
                           # reward
                           | {"test_timeout", "no_test_results", "no_reward", "bad_reward"})
log = logging.getLogger(__name__)


class VerdictStatus(str, Enum):
    """The outcome of a graded episode: the one vocabulary of tasks, evaluation and RL."""

    PASSED = "passed"
    FAILED = "failed"              # the agent's fault
    INFRA_ERROR = "infra_error"    # ours: never a reward
    UNSUPPORTED = "unsupported"    # this machine cannot run the task: never a reward

    @property
    def scored(self) -> bool:
        """Passed or failed: the agent's result. The other two are never a reward."""
        return self in (VerdictStatus.PASSED, VerdictStatus.FAILED)


@dataclass
class Verdict:
    status: VerdictStatus
    tests_passed: int = 0
    tests_total: int = 0
    detail: str = ""
    reward: float | None = None
    duration_s: float = 0.0
    reason: str | None = None      # failure class: test_timeout, sandbox_error, ...
    tests: list[TestResult] = field(default_factory=list)
    output: str = ""               # tail of the test script's output

    @property
    def passed(self) -> bool:
        return self.status is VerdictStatus.PASSED

    def to_dict(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        d["tests"] = [{"name": t.name, "outcome": t.outcome.value, "message": t.message}
                      for t in self.tests]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        tests = [TestResult(t["name"], Outcome(t["outcome"]), t.get("message", ""))
                 for t in d.get("tests", [])]
        return cls(**{**d, "status": VerdictStatus(d["status"]), "tests": tests})


def infra_error(reason: str, detail: str, t0: float, output: str = "") -> Verdict:
    return Verdict(VerdictStatus.INFRA_ERROR, detail=detail, reason=reason,
                   duration_s=time.perf_counter() - t0, output=output[-OUTPUT_TAIL:])


def verdict_from_error(exc: BaseException, duration_s: float = 0.0) -> Verdict:
    """The verdict for an episode that ended in an exception before or during
    verification: unsupported tasks, set-up failures and sandbox errors."""
    if isinstance(exc, TaskUnsupported):
        return Verdict(VerdictStatus.UNSUPPORTED, detail=exc.reason, reason="unsupported",
                       duration_s=duration_s)
    if isinstance(exc, EnvironmentSetupError):
        return Verdict(VerdictStatus.INFRA_ERROR, detail=exc.reason, reason="setup_failed",
                       duration_s=duration_s)
    if isinstance(exc, SandboxError):
        return Verdict(VerdictStatus.INFRA_ERROR, detail=str(exc), reason="sandbox_error",
                       duration_s=duration_s)
    if isinstance(exc, RidgelineError):
        return Verdict(VerdictStatus.INFRA_ERROR, detail=str(exc), reason="harness_error",
                       duration_s=duration_s)
    return Verdict(VerdictStatus.INFRA_ERROR, detail=f"{type(exc).__name__}: {exc}",
                   reason="harness_crash", duration_s=duration_s)


def _finite(x: float) -> float:
    if not math.isfinite(x):
        raise ValueError(f"the reward {x} is not a finite number")
    return x


def _read_reward(sb: TaskSandbox) -> float | None:
    """Harbor's reward: /logs/verifier/reward.txt, else reward.json (None if neither)."""
    logs = sb.logs_host_dir
    txt = hostfs.read_regular(logs, ["verifier", "reward.txt"], MAX_REWARD_BYTES)
    if txt is not None:
        lines = txt.decode("utf-8", "replace").strip().splitlines()
        if not lines:
            raise ValueError("reward.txt is empty")
        return _finite(float(lines[0]))
    js = hostfs.read_regular(logs, ["verifier", "reward.json"], MAX_REWARD_BYTES)
    if js is None:
        return None
    data = json.loads(js)
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return _finite(float(data))
    if isinstance(data, dict) and data:
        if "reward" in data:
            return _finite(float(data["reward"]))
        values = [float(v) for v in data.values()]
        return _finite(sum(values) / len(values))
    raise ValueError("reward.json holds neither a number nor an object of numbers")


class ReportChannel:
    """The host's end of the runner's report socket (`SOCK_SEQPACKET`: one record per
    datagram, never interleaved with another writer's). A thread drains it while the
    tests run, so the runner never blocks on it; what arrives is bounded."""

    def __init__(self) -> None:
        self._host, self.inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.records: list[dict] = []
        self.received = 0
        self.overflow = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True,
                                        name="ridgeline-verifier-report")
        self._thread.start()

    @property
    def fd(self) -> int:
        return self.inner.fileno()

    def _drain(self) -> None:
        while True:
            try:
                ready = select.select([self._host], [], [], 0.05)[0]
                data = self._host.recv(1 << 18) if ready else None
            except (OSError, ValueError):
                return
            if data is None:
                if self._stop.is_set():
                    return          # nothing more queued
                continue
            if not data:
                return              # every sandbox-side holder is gone
            self.received += len(data)
            if self.received > MAX_REPORT_BYTES:
                self.overflow = True
                continue
            try:
                rec = json.loads(data)
            except ValueError:
                continue            # not a runner's record (only sessions are graded)
            if isinstance(rec, dict):
                self.records.append(rec)

    def close_inner(self) -> None:
        self.inner.close()

    def finish(self, timeout: float = 10.0) -> None:
        """Stop after what is queued has been read (call once no runner can write)."""
        self.inner.close()
        self._stop.set()
        self._thread.join(timeout)
        self._host.close()


@dataclass
class Session:
    """One pytest run as its runner reported it."""

    sid: str
    tests: list[TestResult] = field(default_factory=list)
    finished: bool = False
    announced: int = -1         # the number of tests its `finish` record says it sent
    exit_status: int | None = None  # pytest's exit code, from its `finish` record
    corrupt: str = ""

    @property
    def complete(self) -> bool:
        return self.finished and not self.corrupt and self.announced == len(self.tests)


def sessions_of(records: list[dict]) -> list[Session]:
    """Group the runners' records by session. Records of a session that never started
    are ignored (they cannot belong to a runner); anything odd within a started session
    makes it incomplete."""
    out: dict[str, Session] = {}
    for rec in records:
        sid, kind = rec.get("s"), rec.get("e")
        if not isinstance(sid, str) or not sid:
            continue
        if kind == "start":
            if sid in out:
                out[sid].corrupt = "started twice"
            else:
                out[sid] = Session(sid)
            continue
        sess = out.get(sid)
        if sess is None:
            continue
        if sess.finished:
            sess.corrupt = "records after its end"
        elif kind == "test":
            try:
                sess.tests.append(TestResult(str(rec["id"]), Outcome(rec["o"]),
                                             str(rec.get("m", ""))))
            except (KeyError, ValueError):
                sess.corrupt = "an unreadable test record"
        elif kind == "finish":
            sess.finished = True
            n, x = rec.get("n"), rec.get("x")
            sess.announced = n if isinstance(n, int) else -1
            sess.exit_status = x if isinstance(x, int) else None
        else:
            sess.corrupt = f"an unknown record {kind!r}"
    return list(out.values())


# -- what the agent controls, put back before the tests ----------------------------------

def _discard(pfd: int, names: list[str]) -> None:
    """Delete `names` of the directory open as `pfd`: any depth and width, links
    removed and never followed (hostfs.remove_tree). The writable trees may be
    filesystems of their own (volume.py), so nothing can be renamed out of them: what
    the agent left is deleted."""
    for name in names:
        hostfs.remove_tree(pfd, name)


def _make_usable(path: Path, owner: tuple[int, int] | None, rel: str = "") -> None:
    """Give the directory `path` (and each directory of `rel` below it) back the modes
    the tests need (owner rwx, others rx): `chmod 000 /app` is the agent's state, not a
    broken sandbox. Entered by descriptor; a link stops the walk."""
    fd = hostfs.open_dir(path)
    try:
        for part in [p for p in rel.split("/") if p] + [None]:
            st = os.fstat(fd)
            if owner is not None and st.st_uid != owner[0]:
                os.fchown(fd, *owner)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o755)
            if part is None:
                break
            try:
                nfd = hostfs.open_dir(path, part, dir_fd=fd)
            except (OSError, SandboxError):
                break           # missing or a link: the tests' `cd` says so
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)


def _empty_home(sb: TaskSandbox) -> bool:
    """A fresh, empty HOME: every entry of the home mount is deleted, except the
    directories that lead to mounts inside it (a pyenv interpreter under /root), whose
    other entries are. Walked by descriptors: a link is deleted, never entered. True if
    such a directory was not one (the agent moved it): the mounts need a new init."""
    keep: dict[str, set[str]] = {"": set()}
    for m in sb.spec.mounts:
        if m.target.startswith(HOME_PATH + "/"):
            parts = m.target[len(HOME_PATH) + 1:].split("/")
            for i in range(len(parts)):
                keep.setdefault("/".join(parts[:i]), set()).add(parts[i])
    home = sb.staging / "home"
    _make_usable(home, sb.owner)
    moved = False

    def clean(fd: int, rel: str) -> None:
        nonlocal moved
        kept = keep[rel]
        _discard(fd, [n for n in os.listdir(fd) if n not in kept])
        for name in sorted(kept):
            sub = f"{rel}/{name}" if rel else name
            if sub not in keep:
                continue        # a mount point itself: the mount covers it
            try:
                cfd = hostfs.open_dir(home, name, dir_fd=fd)
            except (OSError, SandboxError):
                hostfs.remove_tree(fd, name)    # a link or a file where a mount leads
                moved = True
                continue
            try:
                clean(cfd, sub)
            finally:
                os.close(cfd)

    fd = hostfs.open_dir(home)
    try:
        clean(fd, "")
    finally:
        os.close(fd)
    return moved


def _restore_modes(sb: TaskSandbox, task: Task) -> None:
    ws_rel = ""
    ws = sb.spec.workspace_path
    if task.workdir.startswith(ws.rstrip("/") + "/"):
        ws_rel = task.workdir[len(ws):]
    _make_usable(sb.workspace_dir, sb.owner, ws_rel)
    for d in (sb.logs_host_dir, *sb.extra_dirs.values()):
        _make_usable(d, sb.owner)


def stop_all(sb: TaskSandbox, task: Task) -> None:
    """Kill every process in the sandbox and start a new init. What the agent (or the
    code under test) did to its trees can make that start impossible: `chmod 000 /app`
    (the init starts in the workdir), a link in HOME where a mount of the interpreter
    leads. The processes are gone by then, so the modes are put back, HOME is emptied
    and the start is tried again. Raises if the sandbox still cannot start."""
    try:
        sb.stop_processes()
    except SandboxError:
        _restore_modes(sb, task)
        _empty_home(sb)
        sb.stop_processes()


def reset_agent_state(sb: TaskSandbox, task: Task) -> bool:
    """Call while nothing runs in the sandbox: what the agent may have done to the
    places the verifier needs is undone (see module doc). True if the sandbox needs a
    new init to see its mounts again."""
    _restore_modes(sb, task)
    remount = _empty_home(sb)
    if task.layout is TaskLayout.HARBOR:
        # a new /logs/verifier, made after the kill: nothing of the agent's is in it
        hostfs.fresh_dir(sb.logs_host_dir, "verifier", sb.owner)
    return remount


def agent_filled_disk(sb: TaskSandbox) -> bool:
    """Whether the sandbox's own disk space is used up (by what the agent left): the
    workspace is a filesystem of its own that is (nearly) full, or the measured use of
    its writable trees is at its quota. A full host disk is not the agent's."""
    ws = sb.workspace_dir
    try:
        own_fs = os.stat(ws).st_dev != os.stat(ws.parent).st_dev
        if own_fs:
            st = os.statvfs(ws)
            if st.f_bavail * st.f_frsize < FULL_SLACK_BYTES or st.f_favail == 0:
                return True
    except OSError:
        pass
    quota = getattr(sb.inner, "_quota", None)
    limit = getattr(quota, "limit", None)
    if quota is not None and limit:
        try:
            return quota.used() >= limit - FULL_SLACK_BYTES
        except Exception:  # noqa: BLE001 - a tree it cannot measure: not known full
            log.warning("could not measure the disk use of %s", ws, exc_info=True)
    return False


def _broken(sb: TaskSandbox, detail: str, t0: float, reason: str = "health_failed"
            ) -> Verdict:
    """A sandbox that could not be readied for the tests, or restarted after them: an
    infrastructure error (`reason`), unless the agent filled its disk quota. Then writes fail, and the quota watcher (which bounds
    the sum over the writable trees) kills new sandbox processes as soon as anything else
    is written, so any step or probe may fail: the agent's files are the cause."""
    if agent_filled_disk(sb):
        return _agents_failure("disk_full", f"the workspace is full: the agent's files use "
                               f"the task's whole disk quota ({detail})", t0)
    return infra_error(reason, detail, t0)


def _agents_failure(reason: str, detail: str, t0: float, output: str = "",
                    tests: list[TestResult] | None = None) -> Verdict:
    graded = [r for r in tests or [] if r.outcome is not Outcome.SKIPPED]
    return Verdict(VerdictStatus.FAILED, sum(r.ok for r in graded), len(graded), detail,
                   0.0, time.perf_counter() - t0, reason, list(tests or []),
                   output[-OUTPUT_TAIL:])


def _plugin_env(task: Task, sb: TaskSandbox, harness: tuple[str, ...]) -> dict[str, str]:
    """PYTEST_PLUGINS and PYTHONPATH that load `harness` (modules of HARNESS_MOUNT) into
    every pytest, however it starts (`uvx pytest`, a plain `pytest --ctrf FILE`): the
    reporter first, the task's own plugins next, the CTRF stand-in last (it steps aside
    when a real pytest-json-ctrf registered --ctrf before it)."""
    env = {**sb.spec.env, **task.verifier_env}
    plugins = [p.strip() for p in env.get("PYTEST_PLUGINS", "").split(",") if p.strip()]
    first = [p for p in harness if p == "ridgeline_report"]
    last = [p for p in harness if p not in first and p not in plugins]
    return {"PYTEST_PLUGINS": ",".join(first + [p for p in plugins if p not in first]
                                       + last),
            "PYTHONPATH": ":".join(p for p in (HARNESS_MOUNT, env.get("PYTHONPATH"))
                                   if p)}


def verifier_env(task: Task, sb: TaskSandbox, report_fd: int, nonce: str) -> dict[str, str]:
    env = {"TEST_DIR": TESTS_PATH, **task.verifier_env}
    env.update({
        "RIDGELINE_VERIFY": nonce,
        REPORT_FD_ENV: str(report_fd),
        **_plugin_env(task, sb, HARNESS_PLUGINS),
        "PYTHONNOUSERSITE": "1",
    })
    return env


def verify(task: Task, sandbox: TaskSandbox, timeout: float | None = None) -> Verdict:
    """Run the task's tests in `sandbox` (from `prepare_environment(task)`) and grade.

    A run in which no test ran (`NO_RUN_REASONS`, or tools the offline machine lacks) is
    never the agent's way out of a failure: the workspace the tests run from is the
    agent's, and a `pytest.ini`, `conftest.py` or program of its own there can stop
    pytest or print its errors. The same tests then run in a fresh environment of the
    task without the agent's changes (a control, once per task, environment mode and
    backend in this process): if they run there, the agent's changes stopped them, its
    failure; if they do not, the cause is the task or this machine (infra_error or
    unsupported, as before)."""
    t0 = time.perf_counter()
    if not isinstance(sandbox, TaskSandbox) or sandbox.task.path != task.path:
        raise TaskError(f"verify({task.id!r}) needs the sandbox made by "
                        f"prepare_environment() for that task",
                        hint="call prepare_environment(task) and pass its result")
    verdict = _verify_task(task, sandbox, timeout, t0)
    if not _checked_by_control(verdict):
        return verdict
    return _judge_by_control(task, sandbox, timeout, verdict, t0)


def _verify_task(task: Task, sandbox: TaskSandbox, timeout: float | None,
                 t0: float) -> Verdict:
    """In the agent's environment, or in the tests' own (Harbor's separate verifier
    environment, tasks/artifacts.py); never with a control run (a control calls this)."""
    if task.verifier_dockerfile is None:
        return _verify(task, sandbox, timeout, t0)
    try:
        stop_all(sandbox, task)
        data = artifacts.collect(task, sandbox)
    except artifacts.ArtifactsTooLarge as e:   # what the agent left: its failure
        return _agents_failure("artifacts_too_large", str(e), t0)
    except (OSError, SandboxError) as e:
        return _broken(sandbox, f"could not take the artifacts for the verifier: {e}", t0)
    vtask = artifacts.verifier_task(task)
    try:
        vsb = prepare_environment(vtask, mode="image")
    except Exception as e:  # noqa: BLE001 - unsupported or infrastructure, never a score
        return verdict_from_error(e, time.perf_counter() - t0)
    with vsb:
        return _verify(vtask, vsb, timeout, t0, after_reset=lambda sb: artifacts.place(sb, data))


def _verify(task: Task, sandbox: TaskSandbox, timeout: float | None, t0: float,
            after_reset: Callable[[TaskSandbox], None] | None = None) -> Verdict:
    """The verification itself. `after_reset` puts what the tests are given (a separate
    verifier's artifacts) once the sandbox's trees are reset for them."""
    try:
        stop_all(sandbox, task)     # nothing of the agent's may run beside the tests
    except Exception as e:     # a sandbox that cannot restart is a broken one
        return _broken(sandbox, f"could not stop the agent's processes: "
                                f"{type(e).__name__}: {e}", t0)
    try:
        if reset_agent_state(sandbox, task):
            sandbox.stop_processes()
    except (OSError, SandboxError) as e:   # a tree gone from under the sandbox
        return _broken(sandbox, f"could not reset the sandbox's trees for the tests: {e}",
                       t0)
    if after_reset is not None:
        try:
            after_reset(sandbox)
        except (OSError, SandboxError) as e:
            return infra_error("staging_failed", f"preparing the tests' inputs failed: {e}",
                               t0)
    try:
        health = sandbox.health()
    except Exception as e:      # a sandbox that cannot even answer is broken
        return _broken(sandbox, f"health probe raised {type(e).__name__}: {e}", t0)
    if not health.healthy:
        failed = [k for k, ok in health.checks.items() if not ok]
        return _broken(sandbox, f"sandbox unhealthy ({', '.join(failed)}): {health.detail}",
                       t0)
    script = task.test_script
    if not script.is_file():
        return infra_error("test_script_missing", f"test script missing: {script}", t0)
    if not task.tests_dir.is_dir():
        return infra_error("test_script_missing", f"tests directory missing: "
                           f"{task.tests_dir}", t0)
    try:
        hostfs.clear_dir(sandbox.tests_host_dir)
        for child in task.tests_dir.iterdir():
            stage_copy(child, sandbox.tests_host_dir)
        if task.layout is TaskLayout.TB_V1:
            stage_copy(script, sandbox.tests_host_dir, "run-tests.sh")
            cmd = ["bash", f"{TESTS_PATH}/run-tests.sh"]
        else:
            cmd = ["bash", f"{TESTS_PATH}/test.sh"]
    except (OSError, SandboxError) as e:
        return infra_error("staging_failed", f"copying the tests in failed: {e}", t0)
    limit = timeout if timeout is not None else task.test_timeout_s
    if not _passes_fds(sandbox):
        return _verify_without_channel(task, sandbox, cmd, limit, t0)
    channel = ReportChannel()
    try:
        env = verifier_env(task, sandbox, channel.fd, os.urandom(16).hex())
        try:
            res = sandbox.run(cmd, timeout=limit, env=env, cwd=task.workdir,
                              pass_fds=(channel.fd,))
        except SandboxError as e:
            return infra_error("sandbox_error", f"sandbox failed while testing: {e}", t0)
        channel.close_inner()
        try:
            # what the tests left running (a reward writer, a holder of the report
            # socket) ends before anything is read
            stop_all(sandbox, task)
        except Exception as e:  # noqa: BLE001 - a sandbox that cannot restart is broken
            return _broken(sandbox, f"could not stop the tests' processes: "
                                    f"{type(e).__name__}: {e}", t0, "sandbox_error")
    finally:
        channel.finish()
    return _grade(task, sandbox, res, sessions_of(channel.records), channel.overflow, limit,
                  t0)


# -- the control: a run that ran no test, repeated without the agent's changes ----------

@dataclass(frozen=True)
class _Control:
    """What the task's tests did in a fresh environment of the task (no agent, no
    solution): `ran` (they ran: graded passed or failed), `no_run` (they ran no test
    either), `inconclusive` (another infrastructure error) or `setup_failed` (the
    environment could not be made). Never holds anything of an agent's sandbox."""

    outcome: str
    reason: str | None
    detail: str


_controls: dict[tuple[str, str, str], _Control] = {}
_controls_lock = threading.Lock()
_control_locks: dict[tuple[str, str, str], threading.Lock] = {}


def clear_control_cache() -> None:
    """Forget the control runs made so far in this process (a task changed on disk)."""
    with _controls_lock:
        _controls.clear()


def _checked_by_control(v: Verdict) -> bool:
    """Whether `v` says that no test ran for a cause that is not the agent's (by the
    classification of `_grade`): such a verdict stands only if a control agrees."""
    return ((v.status is VerdictStatus.INFRA_ERROR and v.reason in NO_RUN_REASONS)
            or (v.status is VerdictStatus.UNSUPPORTED and v.reason == "unsupported"))


def _control_key(task: Task, sandbox: TaskSandbox) -> tuple[str, str, str]:
    backend = str(getattr(sandbox.inner, "backend", None) or "bwrap")
    mode = "image" if sandbox.image is not None else "host"
    return str(task.path), mode, backend


def _run_control(task: Task, mode: str, backend: str, timeout: float | None) -> _Control:
    """Prepare a fresh environment of `task` and verify it as it is (no control of its
    own: `_verify`, not `verify`)."""
    try:
        with prepare_environment(task, backend=backend, mode=mode) as fresh:
            v = _verify_task(task, fresh, timeout, time.perf_counter())
    except (TaskUnsupported, EnvironmentSetupError, SandboxError) as e:
        err = verdict_from_error(e)
        return _Control("setup_failed", err.reason, err.detail)
    if v.status.scored:
        return _Control("ran", v.reason, v.detail)
    if _checked_by_control(v):
        return _Control("no_run", v.reason, v.detail)
    return _Control("inconclusive", v.reason, v.detail)


def _control(task: Task, sandbox: TaskSandbox, timeout: float | None) -> _Control:
    """The control of `task` in the environment mode and backend of `sandbox`, run once
    per process (concurrent episodes of one task wait for the first). A control that
    could not be set up is not kept: that may pass."""
    key = _control_key(task, sandbox)
    with _controls_lock:
        lock = _control_locks.setdefault(key, threading.Lock())
    with lock:
        with _controls_lock:
            cached = _controls.get(key)
        if cached is not None:
            return cached
        result = _run_control(task, key[1], key[2], timeout)
        if result.outcome != "setup_failed":
            with _controls_lock:
                _controls[key] = result
        return result


def _judge_by_control(task: Task, sandbox: TaskSandbox, timeout: float | None,
                      verdict: Verdict, t0: float) -> Verdict:
    """`verdict` (no test ran) against the control: the agent's failure if the tests
    run without its changes, else `verdict` with what the control showed."""
    try:
        ctl = _control(task, sandbox, timeout)
    except Exception as e:  # harness trouble (logged): the verdict stays ours
        log.warning("control run of %s failed", task.id, exc_info=True)
        ctl = _Control("setup_failed", "harness_crash", f"{type(e).__name__}: {e}")
    what = f"{verdict.reason}: {verdict.detail}"
    if ctl.outcome == "ran":
        return _agents_failure(
            "tests_did_not_run", f"no test ran ({what}), but the tests do run in a fresh "
            f"environment of the task without the agent's changes ({ctl.detail}): the "
            f"agent's changes stopped them", t0, verdict.output, verdict.tests)
    if ctl.outcome == "no_run":
        note = (f"the same happened also without the agent's changes, in a fresh "
                f"environment of the task ({ctl.reason}: {ctl.detail})")
    elif ctl.outcome == "inconclusive":
        note = (f"a control run in a fresh environment of the task, without the agent's "
                f"changes, did not grade either ({ctl.reason}: {ctl.detail})")
    else:
        note = (f"the control run without the agent's changes could not be set up "
                f"({ctl.reason}: {ctl.detail}): harness trouble")
    verdict.detail = f"{verdict.detail}; {note}"
    verdict.duration_s = time.perf_counter() - t0
    return verdict


def _passes_fds(sandbox: TaskSandbox) -> bool:
    """Whether the backend can hand the report socket to the test script (one that
    starts processes on this host: bwrap)."""
    try:
        return "pass_fds" in inspect.signature(sandbox.inner.run).parameters
    except (TypeError, ValueError):
        return False


def _verify_without_channel(task: Task, sandbox: TaskSandbox, cmd: list[str],
                            limit: float, t0: float) -> Verdict:
    """Backends that cannot pass a descriptor (docker exec): graded from pytest's
    printed summary, which the code under test can forge (docs/security.md)."""
    env = {"TEST_DIR": TESTS_PATH, **task.verifier_env, "PYTHONNOUSERSITE": "1",
           **_plugin_env(task, sandbox, ("ridgeline_ctrf",))}
    try:
        res = sandbox.run(cmd, timeout=limit, env=env, cwd=task.workdir)
        stop_all(sandbox, task)
    except (OSError, SandboxError) as e:
        return _broken(sandbox, f"sandbox failed while testing: {e}", t0, "sandbox_error")
    return _grade(task, sandbox, res, None, False, limit, t0)


def no_test_run(output: str, sessions: list[Session] | None) -> tuple[str, str] | None:
    """(reason, detail) when the test script's pytest ran no test for a cause of its
    own (a usage error, an unloadable conftest or plugin, nothing collected, pytest not
    installed), else None. Call only when no test result came back. `sessions` are the
    runners' complete reports (None: no report channel, the output is all there is):
    when a runner reported, its exit code decides; a pytest that printed a session it
    did not report is tampered with, never a reason of ours."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", output)
    found = None
    for pattern, reason, what in NO_RUN_LINES:
        if (m := pattern.search(text)) is not None:
            found = (reason, f"{what}: {m.group(0).strip()[:300]}")
            break
    if sessions:
        exits = [s.exit_status for s in sessions]
        code = next((x for x in exits if x in NO_RUN_EXITS), None)
        if code is None:
            return None     # interrupted, or ended as the tests' code made it end
        reason, what = NO_RUN_EXITS[code]
        line = f": {found[1].split(': ', 1)[1]}" if found and found[0] == reason else ""
        return reason, f"{what} (exit code {code}){line}"
    if sessions is not None and PYTEST_HEADER in text:
        return None
    return found


def _grade(task: Task, sandbox: TaskSandbox, res, sessions: list[Session] | None,
           overflow: bool, limit: float, t0: float) -> Verdict:
    """The verdict from what the test script did and what its runners reported
    (`sessions` None: no report channel, pytest's printed summary instead)."""
    output = res.stdout + ("\n" + res.stderr if res.stderr else "")
    if res.timed_out:
        return infra_error("test_timeout", f"tests did not finish within {limit:g}s and "
                           f"were killed", t0, output)
    channel = sessions is not None
    if sessions is None:
        results = parse_pytest_output(res.stdout) or parse_pytest_output(output)
        sessions = []
    else:
        results = [t for sess in sessions for t in sess.tests]
    if res.killed_by and res.killed_by != "output":
        # memory, disk, file size, CPU or a signal from inside: what the tests ran (the
        # agent's work) broke the task's limits or killed its runner
        return _agents_failure("test_killed", f"the tests were killed ({res.killed_by})",
                               t0, output, results)
    broken = [sess for sess in sessions if not sess.complete]
    if broken or overflow:
        why = (f"{broken[0].corrupt}" if broken and broken[0].corrupt else
               "no end" if broken else "too much report data")
        return _agents_failure(
            "runner_killed", f"the test runner did not report its end ({why}): the code "
            f"under test killed or replaced it (exit code {res.exit_code})", t0, output,
            results)
    graded = [r for r in results if r.outcome is not Outcome.SKIPPED]
    n_pass = sum(r.ok for r in graded)
    duration = time.perf_counter() - t0
    offline = [ln.split(OFFLINE_MARK, 1)[1].strip() for ln in output.splitlines()
               if OFFLINE_MARK in ln]

    def explained_absence(missing: str) -> Verdict | None:
        """The verdict where `missing` (no reward, no test results) has a known cause:
        the tests need what this machine lacks offline, or the agent filled the disk."""
        if offline and not sessions:
            return Verdict(VerdictStatus.UNSUPPORTED, detail=offline[0],
                           reason="unsupported", duration_s=duration,
                           output=output[-OUTPUT_TAIL:])
        if agent_filled_disk(sandbox):
            return _agents_failure("disk_full", f"{missing}, and the workspace is full of "
                                   "the agent's files", t0, output, results)
        return None

    # A pytest that ran no test decides nothing: neither the reward the script wrote
    # after it (its `$?` is pytest's usage error, not the agent's work) nor a failure.
    no_run = None if results else no_test_run(output, sessions if channel else None)
    if task.layout is TaskLayout.HARBOR:
        if no_run is not None or (offline and not results and not sessions):
            if (verdict := explained_absence("no test ran")) is not None:
                return verdict
        if no_run is not None:
            return infra_error(no_run[0], f"{no_run[1]}; no test ran, so the reward file "
                               f"was not read (exit code {res.exit_code})", t0, output)
        try:
            reward = _read_reward(sandbox)
        except hostfs.UnsafeEntryError as e:
            return infra_error("bad_reward", f"refused to read the reward: {e}", t0, output)
        except (ValueError, OSError, json.JSONDecodeError) as e:
            return infra_error("bad_reward", f"unreadable reward file: {e}", t0, output)
        if reward is None:
            if (verdict := explained_absence("no reward")) is not None:
                return verdict
            return infra_error("no_reward", f"the verifier wrote no reward to "
                               f"{LOGS_PATH}/verifier/reward.txt (exit code "
                               f"{res.exit_code})", t0, output)
        if reward >= 1.0 and graded and n_pass < len(graded):
            # the reward file is writable by what the tests run; the runner's own
            # report is not: a full reward needs every reported test passed
            return Verdict(VerdictStatus.FAILED, n_pass, len(graded),
                           f"reward file says {reward:g} but the test runner reported "
                           f"{n_pass}/{len(graded)} tests passed", n_pass / len(graded),
                           duration, "report_mismatch", results, output[-OUTPUT_TAIL:])
        status = VerdictStatus.PASSED if reward >= 1.0 else VerdictStatus.FAILED
        detail = f"reward {reward:g}" + (f"; {n_pass}/{len(graded)} tests passed"
                                         if graded else "")
        return Verdict(status, n_pass, len(graded), detail, reward, duration,
                       None if status is VerdictStatus.PASSED else "tests_failed",
                       results, output[-OUTPUT_TAIL:])
    if not graded:
        if (verdict := explained_absence("no test results")) is not None:
            return verdict
        if no_run is not None:
            return infra_error(no_run[0], f"{no_run[1]} (exit code {res.exit_code})", t0,
                               output)
        if channel and PYTEST_HEADER in output:
            # Every pytest the harness starts reports; one that printed a session and
            # did not was disabled or replaced by something the tests reached (the
            # agent's config or code), or its output is forged.
            return _agents_failure("no_test_report", "pytest output but no report from "
                                   "its runner: the run was tampered with or forged", t0,
                                   output)
        return infra_error("no_test_results", f"no pytest results from the test runner "
                           f"(exit code {res.exit_code})", t0, output)
    passed = n_pass == len(graded)
    failed_names = [r.name.split("::")[-1] for r in graded if not r.ok]
    detail = f"{n_pass}/{len(graded)} tests passed" + (
        f"; failed: {', '.join(failed_names[:8])}" if failed_names else "")
    return Verdict(VerdictStatus.PASSED if passed else VerdictStatus.FAILED, n_pass,
                   len(graded), detail, 1.0 if passed else 0.0, duration,
                   None if passed else "tests_failed", results, output[-OUTPUT_TAIL:])
