"""The persistent shell: state between commands, timeouts, a session that stays usable."""

from __future__ import annotations

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import Limits, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import cmdline, needs_bwrap, pids_in_namespace

pytestmark = needs_bwrap


def test_cwd_variables_functions_and_jobs_persist(sandbox):
    sh = sandbox.shell()
    r = sh.send("mkdir -p sub && cd sub && export A=1 && B=2 && f() { echo f$1; }")
    assert r.exit_code == 0 and r.stdout == ""
    r = sh.send("pwd; echo $A$B; f x")
    assert r.stdout == "/workspace/sub\n12\nfx\n"
    sh.send("sleep 1000 &")
    assert "sleep 1000" in sh.send("jobs").stdout
    r = sh.send("echo out; echo err >&2; false")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 1)
    r = sh.send("printf 'no newline'")
    assert r.stdout == "no newline"
    assert sh.send("cat <<'EOF'\nheredoc line\nEOF").stdout == "heredoc line\n"
    sh.close()


def test_commands_cannot_read_the_protocol_stream(sandbox):
    sh = sandbox.shell()
    r = sh.send("cat; read x; echo read=$?")  # stdin is /dev/null: no hang, no theft
    assert r.stdout == "read=1\n"
    assert sh.send("echo still here").stdout == "still here\n"


def test_hanging_command_is_interrupted_and_session_stays_usable(sandbox):
    ns = sandbox.namespaces["pid"]
    sh = sandbox.shell()
    sh.send("cd /tmp; X=kept; sleep 2000 &")
    r = sh.send("sleep 1000", timeout=0.5)
    assert r.timed_out and r.exit_code == 124 and r.killed_by == "timeout"
    r = sh.send("pwd; echo $X; jobs")
    assert r.stdout.startswith("/tmp\nkept\n") and "sleep 2000" in r.stdout
    procs = " ".join(cmdline(p) for p in pids_in_namespace(ns))
    assert "sleep 1000" not in procs and "sleep 2000" in procs


def test_a_shell_stuck_in_builtins_is_restarted(sandbox):
    sh = sandbox.shell()
    sh.send("cd /tmp")
    r = sh.send("while :; do :; done", timeout=0.5)
    assert r.timed_out and "restarted" in r.stderr
    assert sh.send("pwd").stdout == "/tmp\n"  # same directory, new bash


def test_exit_ends_the_session(sandbox):
    sh = sandbox.shell()
    r = sh.send("exit 7")
    assert r.exit_code == 7
    with pytest.raises(SandboxError, match="ended"):
        sh.send("echo hi")
    assert sandbox.shell().send("echo new").stdout == "new\n"


def test_shell_output_cap():
    with create_sandbox(SandboxSpec(limits=Limits(max_output_bytes=100))) as sb:
        sh = sb.shell()
        r = sh.send("head -c 1000 /dev/zero | tr '\\0' a; echo")
        assert r.truncated and r.stdout.startswith("a" * 100) and "truncated" in r.stdout
        assert sh.send("echo next").stdout == "next\n"
        r = sh.send("yes", timeout=60)
        assert r.truncated and r.killed_by == "output"
        assert sh.send("echo after").stdout == "after\n"


#: Ways a command looks for the end marker to print it with a status and cwd of its
#: choosing: the variable that used to hold it, every variable, bash's argv and
#: environment, and every file descriptor bash has open that can be listed.
_FIND = {
    "marker variable": 'm="$__rl_m"',
    "every variable": "m=$(set | grep -o '__RIDGELINE_[0-9a-f]*__' | tail -1)",
    "bash's argv": "m=$(tr '\\0' '\\n' < /proc/$$/cmdline | grep -o '__RIDGELINE_[0-9a-f]*__'"
                   " | tail -1)",
    "bash's environment": "m=$(tr '\\0' '\\n' < /proc/$$/environ | "
                          "grep -o '__RIDGELINE_[0-9a-f]*__' | tail -1)",
}


@pytest.mark.parametrize("where", sorted(_FIND))
def test_a_command_cannot_forge_its_end_marker(sandbox, where):
    sh = sandbox.shell()
    sh.send("cd /tmp")
    forge = (_FIND[where] + '; echo "found=[$m]"; cd /; '
             "printf '\\n%s 0 /forged\\n' \"$m\"; printf '\\n%s\\n' \"$m\" >&2; "
             "echo after-the-marker; cd /tmp; false")
    r = sh.send(forge)
    # The attack ran to its end: everything it printed, the fake marker line included,
    # is the command's output, and the status and cwd are the real ones.
    assert "after-the-marker" in r.stdout, r
    assert "0 /forged" in r.stdout
    assert r.exit_code == 1
    assert sh.send("pwd").stdout == "/tmp\n"
    if where == "bash's argv":  # positive control: a marker-shaped token was found
        assert "found=[__RIDGELINE_" in r.stdout
    # The session is in step: the next command gets its own output and status.
    r = sh.send("echo next; exit_code_probe() { return 3; }; exit_code_probe")
    assert (r.stdout, r.exit_code) == ("next\n", 3)
