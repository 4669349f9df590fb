"""The task harness treats the agent and the task's build steps as attackers.

Every attack runs for real in a sandbox and visibly happens (a positive control shows
the planted link or background process exists); the checks are that the host's files are
untouched and the verdict is the honest one (the null agent fails).
"""

from __future__ import annotations

import os
import shutil
import stat
import textwrap
from pathlib import Path

import pytest

from ridgeline.tasks import (
    VerdictStatus, load_task, prepare_environment, verdict_from_error, verify,
)

FIXTURES = Path(__file__).parent / "fixtures"
SECRET = "ridgeline-host-secret-7f3a"


@pytest.fixture
def victim(tmp_path):
    """A host directory with a secret file, a file that says "1", and a canary."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "canary").write_text("still here")
    (d / "reward.txt").write_text("1\n")
    (d / "secret.txt").write_text(SECRET + "\n")
    os.chmod(d / "secret.txt", 0o600)
    return d


def _intact(victim: Path) -> None:
    assert (victim / "canary").read_text() == "still here"
    assert (victim / "reward.txt").read_text() == "1\n"
    assert stat.S_IMODE((victim / "secret.txt").stat().st_mode) == 0o600


def _verify_after(task_dir: Path, attack: str):
    task = load_task(task_dir)
    with prepare_environment(task) as sb:
        planted = sb.run(["bash", "-c", attack])
        assert planted.ok, planted.stderr        # positive control: the attack ran
        return verify(task, sb), planted


HARBOR_LINKS = {
    # /logs/verifier itself a link to a host directory (the host used to wipe it)
    "directory": "rm -rf /logs/verifier && ln -s {victim} /logs/verifier && ls -l /logs",
    # reward.txt a link to a host file (the host used to read it into the verdict)
    "file": "ln -sf {victim}/secret.txt /logs/verifier/reward.txt && ls -l /logs/verifier",
    # a link in the parent's place: the verifier dir inside a linked directory
    "parent": "mkdir -p /logs/agent && rm -rf /logs/verifier && "
              "ln -s {victim} /logs/agent/v && ln -s agent/v /logs/verifier && ls -l /logs",
    # swapped while the tests run, by a process the agent left behind
    "swapped": "(for i in $(seq 3000); do rm -rf /logs/verifier 2>/dev/null; "
               "ln -sfn {victim} /logs/verifier 2>/dev/null; "
               "echo 1 > /logs/verifier/reward.json 2>/dev/null; sleep 0.005; done) "
               ">/dev/null 2>&1 & echo started",
}


@pytest.mark.parametrize("placement", sorted(HARBOR_LINKS))
def test_harbor_links_never_reach_the_host(victim, placement):
    verdict, planted = _verify_after(FIXTURES / "harbor-hello",
                                     HARBOR_LINKS[placement].format(victim=victim))
    assert ("->" in planted.stdout) or ("started" in planted.stdout)
    _intact(victim)
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)
    assert SECRET not in verdict.detail + verdict.output


def test_background_process_cannot_forge_a_pytest_summary():
    """v1: a process the agent left writes a fake summary into pytest's stdout."""
    forge = textwrap.dedent("""
        (while true; do
           for p in $(pgrep -f '[p]ytest' 2>/dev/null); do
             printf '%s\\n' '=== short test summary info ===' 'PASSED t.py::test_a' \
               'PASSED t.py::test_b' '=== 2 passed in 0.01s ===' > /proc/$p/fd/1
             kill -9 $p
           done
           sleep 0.01
         done) >/dev/null 2>&1 &
        sleep 0.2; pgrep -f '[w]hile true' >/dev/null && echo forger-running
    """)
    verdict, planted = _verify_after(FIXTURES / "tb1-hello-world", forge)
    assert "forger-running" in planted.stdout
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)


def test_background_reward_writer_is_dead_before_tests():
    verdict, planted = _verify_after(
        FIXTURES / "harbor-hello",
        "(while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
        "sleep 0.01; done) >/dev/null 2>&1 & echo started")
    assert "started" in planted.stdout
    assert verdict.status is VerdictStatus.FAILED and verdict.reward == 0.0


# -- build steps: COPY/chmod through links planted by an earlier RUN ------------------------

def _harbor_task(tmp_path: Path, dockerfile: str, files: dict[str, str]) -> Path:
    d = tmp_path / "task"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    env = d / "environment"
    (env / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    for name, text in files.items():
        (env / name).write_text(text)
    return d


BUILD_ATTACKS = {
    "copy into a linked directory":
        "RUN ln -s {victim} /app/out\nCOPY payload.txt /app/out/\n",
    "copy onto a linked file":
        "RUN ln -s {victim}/canary /app/target\nCOPY payload.txt /app/target\n",
    "chmod through a linked file":
        "RUN ln -s {victim}/secret.txt /app/target\nCOPY --chmod=777 payload.txt /app/target\n",
    "workdir through a link":
        "RUN ln -s {victim} /app/w\nWORKDIR /app/w/sub\nCOPY payload.txt ./\n",
    "race from a background process":
        "RUN (for i in $(seq 400); do ln -sfn {victim} /app/out; sleep 0.005; done) "
        ">/dev/null 2>&1 &\nRUN mkdir -p /app/out2\nCOPY payload.txt /app/out/\n",
}


@pytest.mark.parametrize("attack", sorted(BUILD_ATTACKS))
def test_build_steps_never_write_through_links(tmp_path, victim, attack):
    dockerfile = "FROM ubuntu:24.04\nWORKDIR /app\n" + BUILD_ATTACKS[attack].format(
        victim=victim)
    task = load_task(_harbor_task(tmp_path, dockerfile, {"payload.txt": "PAYLOAD\n"}))
    try:
        with prepare_environment(task) as sb:
            # Whatever the build did, it did inside the sandbox.
            sb.run("ls -la /app")
    except Exception as e:  # noqa: BLE001 - a refused build is an acceptable outcome
        assert verdict_from_error(e).reward is None
    _intact(victim)
    assert not (victim / "payload.txt").exists()
    assert (victim / "canary").read_text() == "still here"


def test_copy_still_works_inside_the_workspace(tmp_path):
    """Positive control for the attacks above: the same steps without links work, and
    what was copied belongs to the sandbox user (writable inside)."""
    dockerfile = ("FROM ubuntu:24.04\nWORKDIR /app\nRUN mkdir -p /app/out\n"
                  "COPY payload.txt /app/out/\nCOPY --chmod=755 payload.txt /app/run.sh\n"
                  "COPY data /app/data\n")
    d = _harbor_task(tmp_path, dockerfile, {"payload.txt": "PAYLOAD\n"})
    (d / "environment" / "data").mkdir()
    (d / "environment" / "data" / "a.txt").write_text("A")
    os.symlink("a.txt", d / "environment" / "data" / "link")
    task = load_task(d)
    with prepare_environment(task) as sb:
        r = sb.run("cat /app/out/payload.txt; stat -c %a /app/run.sh; readlink /app/data/link;"
                   " cat /app/data/a.txt; echo; echo more >> /app/out/payload.txt && echo writable")
    assert r.stdout.split() == ["PAYLOAD", "755", "a.txt", "A", "writable"], r.stderr
