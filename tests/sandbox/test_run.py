"""Running commands in a bwrap sandbox: results, limits, timeouts, output caps."""

from __future__ import annotations

import threading

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import Limits, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import cmdline, needs_bwrap, needs_root, pids_in_namespace

pytestmark = needs_bwrap


def test_result_has_exit_code_and_both_streams(sandbox):
    r = sandbox.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.ok) == (3, "out\n", "err\n", False)


def test_argv_list_is_not_parsed_by_a_shell(sandbox):
    assert sandbox.run(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"


def test_env_is_passed(sandbox):
    assert sandbox.run("echo $FOO", env={"FOO": "bar"}).stdout == "bar\n"


def test_cwd_is_the_workspace_unless_given(sandbox):
    assert sandbox.run("pwd").stdout == "/workspace\n"
    assert sandbox.run(["pwd"], cwd="/tmp").stdout == "/tmp\n"


def test_stdin_small_and_larger_than_a_pipe_buffer(sandbox):
    assert sandbox.run("tr a-z A-Z", stdin=b"hello").stdout == "HELLO"
    assert sandbox.run(["cat"], stdin=b"x" * 300_000).stdout_bytes == b"x" * 300_000


def test_host_environment_does_not_leak(sandbox, monkeypatch):
    monkeypatch.setenv("RIDGELINE_TEST_SECRET", "s3cret")
    with create_sandbox(SandboxSpec(env={"GIVEN": "1"})) as sb:
        env = sb.run("env").stdout
    assert "s3cret" not in env and "GIVEN=1" in env


def test_missing_command_is_exit_127_not_an_exception(sandbox):
    assert sandbox.run("no-such-command-xyz").exit_code == 127
    assert sandbox.run(["no-such-command-xyz"]).exit_code == 127


def test_non_utf8_output_is_kept_raw(sandbox):
    r = sandbox.run(["printf", r"\xff\xfeok"])
    assert r.stdout_bytes == b"\xff\xfeok"
    assert r.stdout.endswith("ok")  # decoded with replacement, never an exception


def test_output_is_truncated_with_a_marker():
    with create_sandbox(SandboxSpec(limits=Limits(max_output_bytes=1000))) as sb:
        r = sb.run("head -c 5000 /dev/zero | tr '\\0' a; echo done >&2")
    assert r.exit_code == 0 and r.truncated and not r.timed_out
    assert r.stdout_bytes.startswith(b"a" * 1000)
    assert b"a" * 1001 not in r.stdout_bytes
    assert "output truncated at 1000 bytes" in r.stdout and "4000 more bytes" in r.stdout
    assert r.stderr == "done\n"


def test_endless_output_is_cut_and_stopped():
    with create_sandbox(SandboxSpec(limits=Limits(max_output_bytes=4096))) as sb:
        r = sb.run("yes", timeout=60)
        assert r.truncated and r.killed_by == "output" and not r.timed_out
        assert len(r.stdout_bytes) < 4096 + 200
        assert sb.run("echo alive").stdout == "alive\n"


def test_timeout_kills_every_process_of_the_command(sandbox):
    ns = sandbox.namespaces["pid"]
    r = sandbox.run("sleep 1000 & setsid sleep 1001 & (sleep 1002 &); sleep 1003",
                    timeout=0.5)
    assert r.timed_out and r.killed_by == "timeout" and r.exit_code == 124
    left = [cmdline(p) for p in pids_in_namespace(ns) if p != sandbox.init_pid]
    assert not [c for c in left if "sleep" in c], left


def test_background_processes_outlive_run_until_close(sandbox):
    ns = sandbox.namespaces["pid"]
    assert sandbox.run("sleep 1000 >/dev/null 2>&1 &").exit_code == 0
    assert "sleep 1000" in sandbox.run("ps -eo args").stdout
    assert len(pids_in_namespace(ns)) >= 2
    sandbox.close()
    assert pids_in_namespace(ns) == []


def test_close_leaves_nothing_behind():
    sb = create_sandbox(SandboxSpec())
    ns, ws, host_dir = sb.namespaces["pid"], sb.workspace_dir, sb.dir
    sb.run("for i in 1 2 3; do setsid sleep 1000 & done; (sleep 1000 &) ; true")
    assert len(pids_in_namespace(ns)) >= 4
    sb.close()
    assert pids_in_namespace(ns) == []
    assert not ws.exists() and not host_dir.exists()
    sb.close()  # idempotent


def test_closed_sandbox_cannot_be_used():
    sb = create_sandbox(SandboxSpec())
    shell = sb.shell()
    sb.close()
    for call in (lambda: sb.run("true"), lambda: sb.write_file("a", "b"),
                 lambda: sb.read_file("a"), lambda: sb.snapshot(), lambda: sb.shell(),
                 lambda: shell.send("true")):
        with pytest.raises(SandboxError):
            call()


def test_concurrent_runs_in_one_sandbox(sandbox):
    results = {}

    def work(i):
        results[i] = sandbox.run(f"echo {i}").stdout

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n" for i in range(8)}


def test_sandbox_created_in_a_short_lived_thread_survives_it():
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("sb", create_sandbox(SandboxSpec())))
    t.start()
    t.join()
    with box["sb"] as sb:  # --die-with-parent must not fire when that thread exits
        assert sb.run("echo ok").stdout == "ok\n"


def test_cpu_time_limit():
    with create_sandbox(SandboxSpec(limits=Limits(cpu_seconds=1))) as sb:
        r = sb.run(["sh", "-c", "while :; do :; done"], timeout=30)
    assert r.killed_by == "cpu" and not r.timed_out


@needs_root
def test_file_size_limit_inside():
    with create_sandbox(SandboxSpec(limits=Limits(max_file_size_bytes=1 << 20))) as sb:
        r = sb.run("head -c 2000000 /dev/zero > big")
        assert r.exit_code != 0 and r.killed_by == "file_size"
        assert (sb.workspace_dir / "big").stat().st_size <= 1 << 20
