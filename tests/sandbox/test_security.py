"""Section 3 of the sandbox issue: each test fails if that part of the isolation breaks."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from ridgeline.sandbox import Limits, NetworkPolicy, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import cmdline, needs_bwrap, needs_root, pids_in_namespace

pytestmark = needs_bwrap
PY = "python3"


@pytest.fixture
def host_server():
    """A TCP server on the host's 127.0.0.1 that accepts connections."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                srv.accept()[0].close()
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


CONNECT = ("import socket,sys\n"
           "try:\n socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=3); print('CONNECTED')\n"
           "except OSError as e: print('FAILED', e)")


@pytest.mark.parametrize("policy", [NetworkPolicy.NONE, NetworkPolicy.LOOPBACK])
def test_host_port_on_loopback_is_unreachable(host_server, policy):
    # The server is reachable from the host itself, so the check below is meaningful.
    socket.create_connection(("127.0.0.1", host_server), timeout=3).close()
    with create_sandbox(SandboxSpec(network=policy)) as sb:
        r = sb.run([PY, "-c", CONNECT, str(host_server)])
    assert "FAILED" in r.stdout and "CONNECTED" not in r.stdout


def test_dns_fails_without_network(sandbox):
    r = sandbox.run([PY, "-c", "import socket\ntry:\n socket.getaddrinfo('example.com', 80); print('RESOLVED')\n"
                             "except OSError as e: print('FAILED', e)"])
    assert "FAILED" in r.stdout


SERVE = ("import socket,time\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "s.bind(('127.0.0.1', 8765)); s.listen(); print('LISTENING', flush=True)\n"
         "while True: s.accept()[0].close()")


def test_loopback_policy_lets_servers_inside_talk():
    with create_sandbox(SandboxSpec(network=NetworkPolicy.LOOPBACK)) as sb:
        sb.run(f"{PY} -c \"{SERVE}\" > /tmp/server.log 2>&1 &")
        sb.run("for i in $(seq 100); do grep -q LISTENING /tmp/server.log && break; sleep 0.05; done")
        r = sb.run([PY, "-c", CONNECT, "8765"])
        assert "CONNECTED" in r.stdout, sb.run("cat /tmp/server.log").stdout


SELF_CONNECT = ("import socket\ns=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
                "try:\n socket.create_connection(s.getsockname(), timeout=3); print('CONNECTED')\n"
                "except OSError as e: print('FAILED', e)")


def test_no_loopback_under_network_none(sandbox):
    assert "FAILED" in sandbox.run([PY, "-c", SELF_CONNECT]).stdout
    with create_sandbox(SandboxSpec(network=NetworkPolicy.LOOPBACK)) as sb:
        assert "CONNECTED" in sb.run([PY, "-c", SELF_CONNECT]).stdout


def test_host_files_are_read_only(sandbox, tmp_path):
    project = Path(__file__).resolve().parents[2]
    for target in ("/etc/ridgeline-probe", "/usr/ridgeline-probe", "/opt/ridgeline-probe",
                   "/ridgeline-probe", f"{project}/ridgeline-probe"):
        r = sandbox.run(["sh", "-c", f"echo x > {target}"])
        assert r.exit_code != 0, target
        assert not os.path.exists(target)
    assert sandbox.run("rm -f /etc/hostname /usr/bin/env").exit_code != 0
    assert os.path.exists("/usr/bin/env")


def test_host_secrets_are_invisible(sandbox):
    assert sandbox.run("ls -A /root").exit_code != 0
    assert sandbox.run("ls -A /home").stdout.split() == ["sandbox"]
    for host_home in {os.path.expanduser("~"), "/root"}:
        assert sandbox.run(["test", "-e", host_home + "/.bashrc"]).exit_code != 0
    assert sandbox.run("cat /etc/shadow").stdout == ""  # masked: readable only by root
    assert Path(__file__).exists() and sandbox.run(["test", "-e", __file__]).exit_code != 0


def test_host_processes_are_invisible_and_cannot_be_signalled(sandbox):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        seen = sandbox.run("ps -eo pid= | wc -l").stdout.strip()
        assert int(seen) < 10  # only the sandbox's own few processes
        r = sandbox.run(f"ls /proc/{victim.pid}; kill -9 {victim.pid}")
        assert r.exit_code != 0
        assert victim.poll() is None  # still alive
        inside_init = sandbox.run("cat /proc/1/cmdline").stdout_bytes
        assert inside_init != Path("/proc/1/cmdline").read_bytes()  # not the host's init
    finally:
        victim.kill()
        victim.wait()


def test_no_capabilities_unprivileged_uid_writable_workspace(sandbox):
    status = sandbox.run("grep -E '^Cap(Inh|Prm|Eff|Amb)' /proc/self/status").stdout
    assert status.count("0000000000000000") == 4, status
    assert sandbox.run("id -u").stdout.strip() == "1000"
    assert sandbox.run("echo hi > made-inside.txt && mkdir -p a/b && touch a/b/c").exit_code == 0
    assert (sandbox.workspace_dir / "made-inside.txt").read_text() == "hi\n"
    # Files the host puts into the workspace (through the files API) are writable inside.
    sandbox.write_file("from-host.txt", "x")
    assert sandbox.run("echo y >> from-host.txt").exit_code == 0
    assert sandbox.run("unshare -U true").exit_code != 0  # no nested user namespaces


def test_sleep_is_killed_at_timeout_with_nothing_left(sandbox):
    ns = sandbox.namespaces["pid"]
    r = sandbox.run("sleep 1000", timeout=1)
    assert r.timed_out and r.killed_by == "timeout"
    left = [cmdline(p) for p in pids_in_namespace(ns) if p != sandbox.init_pid]
    assert left == []


@needs_root
def test_fork_bomb_hits_the_process_limit_and_host_stays_responsive():
    limits = Limits(max_processes=64)
    with create_sandbox(SandboxSpec(limits=limits)) as sb:
        counted = sb.run([PY, "-c", (
            "import os,time\nn=0\ntry:\n for _ in range(2000):\n  if os.fork()==0:\n   time.sleep(60); os._exit(0)\n"
            "  n+=1\nexcept OSError as e: print('LIMIT', n, e.errno, flush=True)\n"
            "os.kill(0, 9)  # the sandbox is full: take the sleepers down with us")], timeout=30)
        assert "LIMIT" in counted.stdout, counted
        assert int(counted.stdout.split()[1]) < 64
        host_ok = []

        def host_probe():
            for _ in range(5):
                host_ok.append(subprocess.run(["true"], timeout=20).returncode == 0)

        t = threading.Thread(target=host_probe)
        t.start()
        bomb = sb.run("(bomb() { bomb | bomb & }; bomb); sleep 30", timeout=3)
        t.join()
        assert bomb.timed_out and all(host_ok) and len(host_ok) == 5
        assert "Resource temporarily unavailable" in bomb.stderr  # fork hit the limit
        left = [p for p in pids_in_namespace(sb.namespaces["pid"]) if p != sb.init_pid]
        assert left == []  # the timeout took every bomb process with it
        assert sb.run("echo alive").stdout == "alive\n"  # the sandbox itself recovers


@needs_root
def test_memory_bomb_is_killed_and_reported():
    with create_sandbox(SandboxSpec(limits=Limits(memory_bytes=64 << 20))) as sb:
        r = sb.run([PY, "-c", "x = b'x' * (512 << 20); print('survived')"], timeout=60)
        assert r.killed_by == "memory" and "survived" not in r.stdout
        r = sb.run(f"{PY} -c \"x = b'x' * (512 << 20)\"; echo after=$?", timeout=60)
        assert r.killed_by == "memory" or "after=137" in r.stdout
        assert sb.run("echo alive").stdout == "alive\n"


def test_loader_variables_never_reach_host_side_helpers(sandbox):
    # The helpers that enter the sandbox (prlimit, nsenter) run as root on the host:
    # LD_DEBUG there would show them in the loader's output. Inside, it must still apply.
    r = sandbox.run("echo $LD_DEBUG", env={"LD_DEBUG": "libs"})
    assert r.stdout == "libs\n"
    assert "nsenter" not in r.stderr and "prlimit" not in r.stderr
    assert "bash" in r.stderr or "env" in r.stderr  # the loader did run inside


def test_sandbox_directories_are_private_to_root(sandbox):
    for d in (sandbox.dir.parent, sandbox.dir):
        assert oct(d.stat().st_mode & 0o777) == "0o700"
