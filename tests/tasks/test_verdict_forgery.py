"""The agent attacks its own verdict (issue 25, findings 1-3), for real in sandboxes.

Each attack first shows that it is live (a positive control: the planted tool runs, the
forged summary is printed, the file modes are set, the memory of a dumpable process is
writable), then that verification ignores it: the null agent still fails, and what the
agent controls never turns its failure into an infrastructure error.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from ridgeline.tasks import (
    VerdictStatus, builtin_suite_dir, load_task, prepare_environment, verify,
)

FIXTURES = Path(__file__).parent / "fixtures"
BUILTIN = builtin_suite_dir()

FAKE_SUMMARY = textwrap.dedent("""\
    =========================== short test summary info ============================
    PASSED /tests/test_outputs.py::test_file_exists
    PASSED /tests/test_outputs.py::test_file_content
    PASSED /tests/test_outputs.py::test_hello_file_exists
    PASSED /tests/test_outputs.py::test_hello_file_contents
    PASSED /tests/test_outputs.py::test_output
    ============================== 5 passed in 0.01s ===============================
    """)
#: Where every forging tool logs that it ran, and whether that was during verification
#: (the verifier sets RIDGELINE_VERIFY; the agent's own commands never have it).
RAN_LOG = "/app/.forger-ran"


def _forger(kind: str) -> str:
    """A shell script that logs, prints the fake summary, claims a reward, exits 0."""
    return (f'#!/bin/sh\necho "{kind} verify=${{RIDGELINE_VERIFY:-no}}" >> {RAN_LOG}\n'
            f"cat <<'EOF'\n{FAKE_SUMMARY}EOF\n"
            "[ -d /logs/verifier ] && echo 1 > /logs/verifier/reward.txt\nexit 0\n")


def _py_forger(kind: str) -> str:
    """Python that forges from inside an interpreter's start-up when it runs pytest."""
    return textwrap.dedent(f"""\
        import os, sys
        with open("{RAN_LOG}", "a") as f:
            f.write("{kind} verify=" + os.environ.get("RIDGELINE_VERIFY", "no") + "\\n")
        if "pytest" in " ".join(getattr(sys, "orig_argv", sys.argv)) or \
                os.environ.get("FORGE_NOW"):
            os.write(1, {FAKE_SUMMARY!r}.encode())
            if os.path.isdir("/logs/verifier"):
                open("/logs/verifier/reward.txt", "w").write("1\\n")
            os._exit(0)
        """)


def _write(path: str, text: str, mode: str = "644") -> str:
    return (f"mkdir -p $(dirname {path}) && cat > {path} <<'RLEOF'\n{text}RLEOF\n"
            f"chmod {mode} {path}\n")


HOME_TOOLS = (
    _write("$HOME/.local/bin/uv", _forger("home-uv"), "755")
    + _write("$HOME/.local/bin/uvx", _forger("home-uvx"), "755")
    + _write("$HOME/.local/bin/env", 'export PATH="$HOME/.local/bin:$PATH"\n')
    # the uv installer idiom would relink uv/uvx: a read-only directory keeps them
    + "chmod 555 $HOME/.local/bin\n"
    + ". $HOME/.local/bin/env && cd /app && uvx pytest /tests\n")

USER_SITE_PTH = (
    _write("$HOME/.local/lib/python3.11/site-packages/forge_user_site.py",
           _py_forger("user-site"))
    + _write("$HOME/.local/lib/python3.11/site-packages/forge.pth",
             "import forge_user_site\n")
    # any interpreter with user site-packages on runs it (the system one is not a venv)
    + "FORGE_NOW=1 /usr/bin/python3.11 -c pass\n")

PREPOPULATED_VENV = (
    _write("/app/.tbench-testing-venv/bin/activate",
           'export PATH="/app/.tbench-testing-venv/bin:$PATH"\n')
    + _write("/app/.tbench-testing-venv/bin/uv", _forger("venv-uv"), "755")
    + _write("/app/.tbench-testing-venv/bin/pytest", _forger("venv-pytest"), "755")
    + _write("/app/.tbench-testing-venv/pyvenv.cfg", "home = /usr/bin\n")
    + "chmod -R a-w /app/.tbench-testing-venv\n"
    + ". /app/.tbench-testing-venv/bin/activate && uv run pytest /tests\n")

PROJECT_VENV = (
    # a light venv as the offline uv makes one, with a sitecustomize of the agent's
    "cd /app && uv venv .venv >/dev/null 2>&1 && "
    + _write("/app/.venv/lib/site-packages/sitecustomize.py", _py_forger("project-venv"))
    + "cd /app && uv run pytest --version\n")

HOME_CHANNELS = {
    "home-tools-tb1": ("tb1-hello-world", HOME_TOOLS),
    "home-tools-harbor": ("harbor-hello", HOME_TOOLS),
    "user-site-pth-builtin": ("builtin:hello-file", USER_SITE_PTH),
    "user-site-pth-harbor": ("harbor-hello", USER_SITE_PTH),
    "prepopulated-testing-venv": ("tb1-hello-world", PREPOPULATED_VENV),
    "project-venv": ("tb1-csv-summary", PROJECT_VENV),
}


def _task_dir(name: str) -> Path:
    return BUILTIN / name.split(":", 1)[1] if name.startswith("builtin:") else FIXTURES / name


def _run_attack(task, attack: str):
    sb = prepare_environment(task)
    planted = sb.run(["bash", "-c", attack], timeout=60)
    return sb, planted


@pytest.mark.parametrize("channel", sorted(HOME_CHANNELS))
def test_agent_files_never_run_as_the_verifiers_tools(channel):
    name, attack = HOME_CHANNELS[channel]
    task = load_task(_task_dir(name))
    sb, planted = _run_attack(task, attack)
    with sb:
        # positive control: in the agent's own environment the planted tool forges
        assert "5 passed" in planted.stdout, (planted.stdout, planted.stderr)
        ran = sb.read_file(RAN_LOG).decode()
        assert "verify=no" in ran
        verdict = verify(task, sb)
        ran_after = sb.read_file(RAN_LOG).decode()
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)
    assert verdict.reward is not None and verdict.reward < 1
    # nothing the agent planted ran during verification
    assert "verify=no" in ran_after and ran_after.count("verify=") == ran.count("verify=")


def test_verification_home_is_fresh_and_user_site_off(tmp_path):
    """The mechanism, seen by the tests themselves: a task whose tests pass only if HOME
    holds nothing of the agent's and user site-packages are off."""
    d = tmp_path / "task"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "tests" / "test_outputs.py").write_text(textwrap.dedent("""\
        import os, site, sys

        def test_home_is_fresh():
            home = os.environ["HOME"]
            left = [n for n in os.listdir(home) if n.startswith("agent-")]
            assert left == [] and not os.path.exists(home + "/.local/bin/uvx.agent")

        def test_no_user_site():
            assert os.environ.get("PYTHONNOUSERSITE") == "1"
            assert not site.ENABLE_USER_SITE
            assert not any("/.local/" in p for p in sys.path)
        """))
    task = load_task(d)
    with prepare_environment(task) as sb:
        planted = sb.run("mkdir -p ~/agent-dir ~/.local/bin && touch ~/agent-file "
                         "~/.local/bin/uvx.agent && chmod 000 ~/agent-dir && ls -A ~")
        assert "agent-file" in planted.stdout and "agent-dir" in planted.stdout
        verdict = verify(task, sb)
    assert verdict.status is VerdictStatus.PASSED, (verdict.detail, verdict.output)
    assert verdict.tests_total == 2


# -- finding 2: the code under test against its runner ----------------------------------

IN_PROCESS_FORGERY = _write("/app/lru.py", textwrap.dedent(f"""\
    import os, stat
    # pytest captures fd 1; its saved copy of the real stdout is another pipe descriptor
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, {FAKE_SUMMARY!r}.encode())
        except OSError:
            pass
    os.write(2, {FAKE_SUMMARY!r}.encode())
    os._exit(0)
    """)) + "echo planted\n"


def test_in_process_forgery_and_exit_is_a_failure():
    task = load_task(BUILTIN / "lru-cache")
    sb, planted = _run_attack(task, IN_PROCESS_FORGERY)
    with sb:
        assert "planted" in planted.stdout
        # positive control: importing the module prints the summary and exits 0
        control = sb.run(["python3", "-c", "import importlib.util as u; "
                          "s = u.spec_from_file_location('lru', '/app/lru.py'); "
                          "s.loader.exec_module(u.module_from_spec(s))"])
        assert control.exit_code == 0 and "5 passed" in control.stderr
        verdict = verify(task, sb)
    assert "5 passed" in verdict.output            # the forgery was printed...
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)
    assert verdict.reason == "runner_killed" and verdict.reward == 0.0


#: Run by the tests as a subprocess of pytest: attacks its parent (the test runner) and
#: the shell above it, and logs what each attempt got.
RUNNER_ATTACK = textwrap.dedent("""\
    import ctypes, json, os, socket, stat, sys
    libc = ctypes.CDLL(None, use_errno=True)
    log = {}
    target = int(os.environ.get("ATTACK_PID") or os.getppid())
    def attempt(name, fn):
        try:
            log[name] = "ok:" + str(fn())
        except OSError as e:
            log[name] = "denied:" + (e.strerror or str(e))
    def mem():
        with open(f"/proc/{target}/mem", "r+b", buffering=0) as f:
            return "open"
    def ptrace():
        if libc.ptrace(16, target, None, None) != 0:    # PTRACE_ATTACH
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        libc.ptrace(17, target, None, None)             # PTRACE_DETACH
        return "attached"
    def fds():
        return len(os.listdir(f"/proc/{target}/fd"))
    attempt("mem", mem)
    attempt("ptrace", ptrace)
    attempt("fds", fds)
    # The report socket: steal it from any process that holds it (the shells above
    # pytest inherited it), send a complete, all-passing session of our own, then kill
    # the real runner so that its session never ends.
    stolen = None
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            pidfd = os.pidfd_open(int(pid))
        except OSError:
            continue
        try:    # the socket keeps the host's descriptor number, which can be large
            held = sorted(int(f) for f in os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            held = range(3, 1024)
        for fd in [f for f in held if f > 2]:
            n = libc.syscall(438, pidfd, fd, 0)           # pidfd_getfd
            if n < 0:
                continue
            if not stat.S_ISSOCK(os.fstat(n).st_mode):
                os.close(n)
                continue
            s = socket.socket(fileno=n)
            if s.type == socket.SOCK_SEQPACKET:
                stolen = s
                break
            s.close()
        if stolen:
            break
    log["socket"] = "stolen" if stolen else "none"
    if stolen and os.environ.get("ATTACK_PID") is None:
        sid = "f" * 32
        for rec in [{"e": "start"}, {"e": "test", "id": "/tests/test_outputs.py::test_output",
                     "o": "passed", "m": ""}, {"e": "finish", "n": 1, "x": 0}]:
            rec["s"] = sid
            stolen.send(json.dumps(rec).encode())
    with open("/app/attack.json", "w") as f:
        json.dump(log, f)
    if os.environ.get("ATTACK_PID") is None:
        os.kill(os.getppid(), 9)
    """)


def test_subprocess_cannot_reach_or_impersonate_the_runner():
    task = load_task(BUILTIN / "fizzbuzz")
    sb, planted = _run_attack(task, _write("/app/fizzbuzz.py", RUNNER_ATTACK))
    with sb:
        # positive control: against an ordinary (dumpable) process of the same user,
        # the same code opens its memory for writing and attaches with ptrace
        control = sb.run("sleep 30 & ATTACK_PID=$! python3 /app/fizzbuzz.py; "
                         "cat /app/attack.json; kill %1")
        assert '"mem": "ok:open"' in control.stdout, control.stdout + control.stderr
        assert '"ptrace": "ok:attached"' in control.stdout
        verdict = verify(task, sb)
        log = sb.read_file("/app/attack.json").decode()
    assert '"mem": "denied' in log and '"ptrace": "denied' in log, log
    assert '"fds": "denied' in log, log
    # it did get the socket from a shell above pytest and sent a passing session of its
    # own: the runner's session, which never ended, still decides
    assert '"socket": "stolen"' in log, log
    assert verdict.reason == "runner_killed", verdict.detail
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)
    assert verdict.reward == 0.0


def _harbor_task_running(tmp_path: Path, program_check: str) -> Path:
    """A Harbor task whose tests run the agent's /app/prog.py."""
    d = tmp_path / "harbor-prog"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    (d / "tests" / "test_outputs.py").write_text(textwrap.dedent(f"""\
        import subprocess, sys

        def test_program():
            r = subprocess.run([sys.executable, "/app/prog.py"], capture_output=True,
                               text=True, timeout=30)
            assert {program_check}
        """))
    return d


def test_harbor_reward_written_by_the_code_under_test(tmp_path):
    task = load_task(_harbor_task_running(tmp_path, 'r.stdout.strip() == "42", r.stderr'))
    attack = _write("/app/prog.py", textwrap.dedent("""\
        import os
        # claim the reward, and keep test.sh from writing its 0 over it
        with open("/logs/verifier/reward.txt", "w") as f:
            f.write("1\\n")
        os.chmod("/logs/verifier/reward.txt", 0o444)
        os.chmod("/logs/verifier", 0o555)
        print("wrong")
        """))
    sb, planted = _run_attack(task, attack + "echo planted")
    with sb:
        assert "planted" in planted.stdout
        verdict = verify(task, sb)
        claimed = (sb.logs_host_dir / "verifier" / "reward.txt").read_text().strip()
    assert claimed == "1", verdict.output  # positive control: the forged reward is there
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)
    assert verdict.reason == "report_mismatch" and verdict.reward == 0.0


# -- finding 3: the agent's state never becomes an infrastructure error --------------------

DEEP = ("python3 -c \"import os\nos.chdir('{where}')\nfor _ in range(1300):\n"
        "    os.mkdir('d'); os.chdir('d')\nprint('deep', len(os.getcwd()))\"")

STATE_ATTACKS = {
    "chmod 555 /app": ("builtin:hello-file", "chmod 555 /app && stat -c %a /app", "555"),
    "chmod 000 /app": ("builtin:hello-file", "chmod 000 /app && stat -c %a /app", "0"),
    "chmod 000 /logs": ("harbor-hello", "chmod 000 /logs && stat -c %a /logs", "0"),
    "chmod 000 /root": ("harbor-hello", "chmod 000 /root && stat -c %a /root", "0"),
    "deep tree in /app": ("builtin:hello-file", DEEP.format(where="/app"), "deep"),
    "deep tree in HOME": ("harbor-hello", DEEP.format(where="/root"), "deep"),
    "deep tree in /logs/verifier": ("harbor-hello", DEEP.format(where="/logs/verifier"),
                                    "deep"),
}


@pytest.mark.parametrize("attack", sorted(STATE_ATTACKS))
def test_agent_state_is_reset_not_an_infra_error(attack):
    name, cmd, shown = STATE_ATTACKS[attack]
    task = load_task(_task_dir(name))
    sb, planted = _run_attack(task, cmd)
    with sb:
        assert planted.ok and shown in planted.stdout, (planted.stdout, planted.stderr)
        verdict = verify(task, sb)
    assert verdict.status is VerdictStatus.FAILED, (verdict.reason, verdict.detail,
                                                    verdict.output)
    assert verdict.reward is not None and verdict.reward < 1


def test_oracle_still_passes_after_the_agent_broke_modes():
    """The reset gives the tests a usable environment: the oracle's work passes even
    after the agent made /app read-only and left a deep tree in HOME."""
    from ridgeline.tasks import apply_solution
    task = load_task(BUILTIN / "hello-file")
    with prepare_environment(task) as sb:
        apply_solution(task, sb)
        r = sb.run(DEEP.format(where="/root") + " && chmod 555 /app")
        assert r.ok, r.stderr
        verdict = verify(task, sb)
    assert verdict.status is VerdictStatus.PASSED, (verdict.detail, verdict.output)


@pytest.mark.parametrize("also", ["", "head -c 4194304 /dev/urandom > /logs/agent-notes; "],
                         ids=["workspace", "workspace-and-logs"])
def test_filling_the_disk_quota_is_the_agents_failure(tmp_path, also):
    """The workspace at its quota (and, in the second case, the sum over the writable
    trees past it, so the quota watcher kills whatever starts next, the verifier's new
    init included): the agent's failure, never an infrastructure error."""
    d = tmp_path / "small"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    toml = (d / "task.toml").read_text().replace("storage_mb = 10240", "storage_mb = 64")
    (d / "task.toml").write_text(toml)
    task = load_task(d)
    with prepare_environment(task) as sb:
        fill = sb.run(also + "for i in $(seq 100); do head -c 1048576 /dev/urandom > "
                      "/app/f$i || break; done; du -sm /app | cut -f1", timeout=60)
        used_mb = int((fill.stdout.split() or ["0"])[-1]) if fill.stdout.strip() else 0
        # positive control: the agent's files reach the quota (writes were refused or
        # the agent was killed for it)
        assert used_mb >= 60 or fill.killed_by == "disk", (fill.stdout, fill.stderr)
        verdict = verify(task, sb)
    assert verdict.status is VerdictStatus.FAILED, (verdict.reason, verdict.detail,
                                                    verdict.output)
    assert verdict.reward is not None and verdict.reward < 1


def _prep_first_task(tmp_path):
    """tb1-hello-world whose test script runs the agent's /app/prep.py before pytest."""
    d = tmp_path / "prep-first"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    script = (d / "run-tests.sh").read_text().replace(
        "uv run pytest", "python3 /app/prep.py\nuv run pytest")
    (d / "run-tests.sh").write_text(script)
    return load_task(d)


def test_forged_output_before_pytest_is_not_a_report(tmp_path):
    """A test script that runs the agent's program before pytest: the program prints
    a whole pytest session and kills the script, so pytest never runs. Printed text is
    not a report: the agent failed (it used to pass)."""
    task = _prep_first_task(tmp_path)
    prep = textwrap.dedent(f"""\
        import os
        print("=" * 29, "test session starts", "=" * 30)
        print({FAKE_SUMMARY!r}, flush=True)
        os.kill(os.getppid(), 9)
        """)
    sb, planted = _run_attack(task, _write("/app/prep.py", prep) + "python3 /app/prep.py")
    with sb:
        assert "5 passed" in planted.stdout       # positive control: it prints a pass
        verdict = verify(task, sb)
    assert "5 passed" in verdict.output
    assert verdict.status is VerdictStatus.FAILED, (verdict.detail, verdict.output)
    assert verdict.reason in ("no_test_report", "test_killed"), verdict.detail


def test_sessions_need_their_start_and_a_complete_end():
    """Grading of the runner's records: only started sessions count, a session whose
    end is missing, short or followed by more records is incomplete."""
    from ridgeline.tasks.verifier import sessions_of
    t = {"e": "test", "id": "t.py::a", "o": "passed", "m": ""}
    good = [{"s": "A", "e": "start"}, {**t, "s": "A"}, {"s": "A", "e": "finish", "n": 1}]
    assert [s.complete for s in sessions_of(good)] == [True]
    # a "session" that never started (someone else's records) is not graded at all
    assert sessions_of([{**t, "s": "B"}, {"s": "B", "e": "finish", "n": 1}]) == []
    assert not sessions_of(good[:2])[0].complete                         # no end
    assert not sessions_of(good[:1] + good[2:])[0].complete              # a test lost
    assert not sessions_of(good + [{**t, "s": "A"}])[0].complete         # after its end
    assert not sessions_of(good[:1] + good)[0].complete                  # started twice
    # a forger's complete session beside the runner's unfinished one
    forged = [{"s": "F", "e": "start"}, {**t, "s": "F"}, {"s": "F", "e": "finish", "n": 1}]
    assert [s.complete for s in sessions_of(good[:2] + forged)] == [False, True]


def test_home_reset_never_follows_the_agents_links(tmp_path):
    """HOME is emptied by descriptors: a link the agent put where a mount leads (the
    host's pyenv interpreter lives under /root here) is deleted, never entered, and the
    tests still find their interpreter."""
    from ridgeline.tasks.environment import interpreter_mounts
    from ridgeline.tasks.harness import harness_tools
    under_home = [m.target for m in interpreter_mounts(harness_tools())
                  if m.target.startswith("/root/")]
    victim = tmp_path / "victim"
    (victim / "versions").mkdir(parents=True)
    (victim / "canary").write_text("still here")
    (victim / "versions" / "canary").write_text("still here")
    first = under_home[0].split("/")[2] if under_home else ".pyenv"
    task = load_task(BUILTIN / "hello-file")
    attack = (f"mkdir -p /root/{first} && mv /root/{first} /root/moved && "
              f"ln -s {victim} /root/{first} && ls -la /root")
    sb, planted = _run_attack(task, attack)
    with sb:
        assert planted.ok and "->" in planted.stdout, planted.stderr
        verdict = verify(task, sb)
    assert (victim / "canary").read_text() == "still here"
    assert (victim / "versions" / "canary").read_text() == "still here"
    assert verdict.status is VerdictStatus.FAILED, (verdict.reason, verdict.detail,
                                                    verdict.output)
    assert verdict.tests_total == 2        # the interpreter was found: the tests ran


def test_code_under_test_locking_the_workdir_is_a_failure():
    """The code under test makes /app unusable while the tests run: the sandbox still
    restarts after them (modes put back), and the verdict is the agent's failure."""
    task = load_task(BUILTIN / "fizzbuzz")
    attack = (_write("/app/fizzbuzz.py", "import os\nos.chmod('/app', 0)\n")
              + "cd / && python3 /app/fizzbuzz.py && stat -c %a /app && chmod 755 /app")
    sb, planted = _run_attack(task, attack)
    with sb:
        assert planted.ok and planted.stdout.split()[-1] == "0", planted.stderr
        verdict = verify(task, sb)
        assert sb.run("pwd").ok          # usable after verification
    assert verdict.status is VerdictStatus.FAILED, (verdict.reason, verdict.detail,
                                                    verdict.output)


# -- the agent's workspace stops pytest: never an infrastructure error --------------------

#: What the agent leaves where the tests are collected, and what pytest then says.
STOPPERS = {
    "pytest.ini": ("[pytest]\naddopts = --no-such-option\n", "--no-such-option"),
    "conftest.py": ("raise RuntimeError('the agent stops pytest here')\n",
                    "conftest"),
}


@pytest.mark.parametrize("name", sorted(STOPPERS))
def test_agent_config_that_stops_pytest_is_a_failure(tmp_path, name):
    """A test script that collects the tests in the workdir (the agent's /app) reads the
    agent's pytest.ini and conftest.py there. (Tests collected from /tests cannot be
    reached: the verifier restages that read-only mount.) pytest stopping on them is
    the agent's failure: the same tests run in a fresh environment of the task."""
    d = tmp_path / "in-workdir"
    shutil.copytree(FIXTURES / "tb1-hello-world", d)
    (d / "run-tests.sh").write_text("#!/bin/bash\ncp $TEST_DIR/test_outputs.py /app/ && "
                                    "cd /app && pytest test_outputs.py -rA\n")
    task = load_task(d)
    text, shown = STOPPERS[name]
    sb, planted = _run_attack(task, _write(f"/app/{name}", text)
                              + "cd /app && echo 'def test_x(): pass' > t_probe.py && "
                                "pytest t_probe.py; echo rc=$?; rm t_probe.py")
    with sb:
        # positive control: in the agent's own environment pytest stops on the file
        said = planted.stdout + planted.stderr
        assert "rc=4" in said and shown in said, said
        verdict = verify(task, sb)
    assert verdict.status is VerdictStatus.FAILED, (verdict.reason, verdict.detail,
                                                    verdict.output)
    assert verdict.reason == "tests_did_not_run" and verdict.reward == 0.0
    assert "pytest_usage_error" in verdict.detail and shown in verdict.output


def test_program_printing_pytest_errors_is_a_failure(tmp_path):
    """A test script that runs the agent's program before pytest: the program prints a
    pytest usage error and ends the script (here by flooding its output), so pytest
    never runs. Printed text is not the task's fault: without the program the tests
    run."""
    task = _prep_first_task(tmp_path)
    prep = textwrap.dedent("""\
        import sys
        print("ERROR: usage: pytest [options] [file_or_dir] [file_or_dir] [...]")
        print("pytest: error: unrecognized arguments: --forged", flush=True)
        while True:
            sys.stderr.write("x" * 65536)
        """)
    sb, planted = _run_attack(task, _write("/app/prep.py", prep) + "echo planted")
    with sb:
        assert "planted" in planted.stdout
        verdict = verify(task, sb)
    assert verdict.status is VerdictStatus.FAILED, (verdict.reason, verdict.detail,
                                                    verdict.output)
    assert verdict.reason == "tests_did_not_run" and verdict.reward == 0.0
    assert "--forged" in verdict.detail            # the forgery was what was read
