"""The verifier: after the agent, copy the tests in, run the task's test script under its
timeout, and turn what happened into a `Verdict`.

Before anything is staged, every process in the sandbox is killed (the agent's
background jobs included), so nothing the agent left behind can swap, forge or race the
tests and their results. Harbor's `/logs/verifier` is then replaced by a fresh, empty
directory, and the reward is read by the host through directory descriptors that never
follow a link (`sandbox.hostfs`): a link the agent planted is an error, never a path.

`passed`/`failed` are the agent's result. `infra_error` (sandbox crash, failed health
probe, missing test script, test timeout, no test results, missing reward file) and
`unsupported` (the test script needs what this machine cannot provide) are not: their
`reward` is None, never 0, so they never become a training signal.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from enum import Enum

from ridgeline.errors import RidgelineError, SandboxError, TaskError
from ridgeline.sandbox import hostfs
from ridgeline.tasks.environment import (
    LOGS_PATH, TESTS_PATH, EnvironmentSetupError, TaskSandbox, TaskUnsupported,
    stage_copy,
)
from ridgeline.tasks.harness import OFFLINE_MARK
from ridgeline.tasks.model import Task, TaskLayout
from ridgeline.tasks.pytest_output import Outcome, TestResult, parse_pytest_output

OUTPUT_TAIL = 4000
#: A reward file is a number or a small JSON object; anything larger is not one.
MAX_REWARD_BYTES = 64 * 1024


class VerdictStatus(str, Enum):
    PASSED = "passed"
    FAILED = "failed"              # the agent's fault
    INFRA_ERROR = "infra_error"    # ours: never a reward
    UNSUPPORTED = "unsupported"    # this machine cannot run the task: never a reward


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


def verify(task: Task, sandbox: TaskSandbox, timeout: float | None = None) -> Verdict:
    """Run the task's tests in `sandbox` (from `prepare_environment(task)`) and grade."""
    t0 = time.perf_counter()
    if not isinstance(sandbox, TaskSandbox) or sandbox.task.path != task.path:
        raise TaskError(f"verify({task.id!r}) needs the sandbox made by "
                        f"prepare_environment() for that task",
                        hint="call prepare_environment(task) and pass its result")
    try:
        sandbox.stop_processes()    # nothing of the agent's may run beside the tests
    except Exception as e:     # a sandbox that cannot restart is a broken one
        return infra_error("health_failed", f"could not stop the agent's processes: "
                           f"{type(e).__name__}: {e}", t0)
    try:
        health = sandbox.health()
    except Exception as e:      # a sandbox that cannot even answer is broken
        return infra_error("health_failed", f"health probe raised {type(e).__name__}: {e}",
                           t0)
    if not health.healthy:
        failed = [k for k, ok in health.checks.items() if not ok]
        return infra_error("health_failed", f"sandbox unhealthy ({', '.join(failed)}): "
                           f"{health.detail}", t0)
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
            # A new directory, made after the kill: nothing of the agent's is in it.
            hostfs.fresh_dir(sandbox.logs_host_dir, "verifier", sandbox.owner)
            cmd = ["bash", f"{TESTS_PATH}/test.sh"]
    except (OSError, SandboxError) as e:
        return infra_error("staging_failed", f"copying the tests in failed: {e}", t0)
    limit = timeout if timeout is not None else task.test_timeout_s
    env = {"TEST_DIR": TESTS_PATH, **task.verifier_env}
    try:
        res = sandbox.run(cmd, timeout=limit, env=env, cwd=task.workdir)
    except SandboxError as e:
        return infra_error("sandbox_error", f"sandbox failed while testing: {e}", t0)
    output = res.stdout + ("\n" + res.stderr if res.stderr else "")
    if res.timed_out:
        return infra_error("test_timeout", f"tests did not finish within {limit:g}s and "
                           f"were killed", t0, output)
    if res.killed_by and res.killed_by != "output":
        return infra_error("test_killed", f"test script killed ({res.killed_by})", t0,
                           output)
    results = parse_pytest_output(res.stdout) or parse_pytest_output(output)
    graded = [r for r in results if r.outcome not in (Outcome.SKIPPED,)]
    n_pass = sum(r.ok for r in graded)
    duration = time.perf_counter() - t0
    offline = [ln.split(OFFLINE_MARK, 1)[1].strip() for ln in output.splitlines()
               if OFFLINE_MARK in ln]
    if task.layout is TaskLayout.HARBOR:
        try:
            reward = _read_reward(sandbox)
        except hostfs.UnsafeEntryError as e:
            return infra_error("bad_reward", f"refused to read the reward: {e}", t0, output)
        except (ValueError, OSError, json.JSONDecodeError) as e:
            return infra_error("bad_reward", f"unreadable reward file: {e}", t0, output)
        if reward is None:
            if offline:
                return Verdict(VerdictStatus.UNSUPPORTED, detail=offline[0],
                               reason="unsupported", duration_s=duration,
                               output=output[-OUTPUT_TAIL:])
            return infra_error("no_reward", f"the verifier wrote no reward to "
                               f"{LOGS_PATH}/verifier/reward.txt (exit code "
                               f"{res.exit_code})", t0, output)
        status = VerdictStatus.PASSED if reward >= 1.0 else VerdictStatus.FAILED
        detail = f"reward {reward:g}" + (f"; {n_pass}/{len(graded)} tests passed"
                                         if graded else "")
        return Verdict(status, n_pass, len(graded), detail, reward, duration,
                       None if status is VerdictStatus.PASSED else "tests_failed",
                       results, output[-OUTPUT_TAIL:])
    if not graded:
        if offline:
            return Verdict(VerdictStatus.UNSUPPORTED, detail=offline[0],
                           reason="unsupported", duration_s=duration,
                           output=output[-OUTPUT_TAIL:])
        return infra_error("no_test_results", f"no pytest results in the test output "
                           f"(exit code {res.exit_code})", t0, output)
    passed = n_pass == len(graded)
    failed_names = [r.name.split("::")[-1] for r in graded if not r.ok]
    detail = f"{n_pass}/{len(graded)} tests passed" + (
        f"; failed: {', '.join(failed_names[:8])}" if failed_names else "")
    return Verdict(VerdictStatus.PASSED if passed else VerdictStatus.FAILED, n_pass,
                   len(graded), detail, 1.0 if passed else 0.0, duration,
                   None if passed else "tests_failed", results, output[-OUTPUT_TAIL:])
