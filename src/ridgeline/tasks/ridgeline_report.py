"""The verifier's own pytest plugin: it reports every test's outcome to the host over a
channel that only the test runner holds, so the verdict never comes from text the code
under test could print.

Stdlib only, and it runs *inside* a task sandbox: the harness loads it into every pytest
run during verification (`-p ridgeline_report` from the offline tools, and
`PYTEST_PLUGINS` for pytest started any other way). The host hands the test script one
end of a `SOCK_SEQPACKET` socket pair and names its descriptor in
`RIDGELINE_REPORT_FD`. When pytest loads this module it

* takes the descriptor (and drops the variable), marks it close-on-exec, so no process
  the tests start inherits it; a socket cannot be reopened through /proc/<pid>/fd;
* makes pytest non-dumpable (`PR_SET_DUMPABLE` 0): the sandbox user has no
  CAP_SYS_PTRACE, so no other process may ptrace it, read or write its memory through
  /proc/<pid>/mem or process_vm_writev, or take its descriptors with pidfd_getfd;
* draws a random session id that never leaves this process but on the socket, which
  nobody in the sandbox can read (the host holds the only other end).

Then it sends, each as one datagram: a `start` record when the session starts (before
any test module is imported), one `test` record per test (collection errors included),
and a `finish` record with the number of tests sent. The host grades a session only if
it finished and every record arrived: a runner that was killed or exited early
(`os._exit` from the module under test) has no `finish`, which is a failure. Another
process holding the socket (one the test script started before pytest) can only add
sessions of its own with other ids; it cannot finish or amend this one.

What this cannot stop: code the tests import runs inside this process and can do
anything this process can (read the id, send records). See docs/security.md.
"""

from __future__ import annotations

import json
import os
import socket
import stat

import pytest

ENV_FD = "RIDGELINE_REPORT_FD"
#: One datagram stays well below the socket's buffer; longer texts are cut.
MAX_TEXT = 2000
PR_SET_DUMPABLE = 4

_sock = None
_session = ""
_sent = 0
_tests: dict = {}


def _non_dumpable() -> None:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:  # noqa: BLE001 - a libc without prctl: nothing more to do
        pass


def _claim():
    fd_text = os.environ.pop(ENV_FD, None)
    if not fd_text or not fd_text.isdigit():
        return None
    fd = int(fd_text)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return None
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    _non_dumpable()
    return sock


def _send(record: dict) -> None:
    global _sock
    if _sock is None:
        return
    record["s"] = _session
    try:
        _sock.send(json.dumps(record).encode())
    except OSError:  # the host went away: nothing else can receive it
        _sock = None


def _cut(text) -> str:
    text = str(text or "")
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT // 2] + " ... " + \
        text[-MAX_TEXT // 2:]


def pytest_configure(config):
    global _sock, _session
    if hasattr(config, "workerinput"):  # an xdist worker: its controller reports
        return
    if _sock is None:
        _sock = _claim()
        _session = os.urandom(16).hex()


@pytest.hookimpl(tryfirst=True)  # the start is on record before anything can fail
def pytest_sessionstart(session):
    _send({"e": "start"})


def pytest_collectreport(report):
    if report.failed:
        _record(report.nodeid or "<collection>", "error", report.longrepr)
        _flush(report.nodeid or "<collection>")


def pytest_runtest_logreport(report):
    outcome = None
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xpass" if report.passed else "xfail" if report.skipped else "failed"
        else:
            outcome = report.outcome  # passed | failed | skipped
    elif report.failed:  # setup or teardown
        outcome = "error"
    elif report.skipped:
        outcome = "xfail" if hasattr(report, "wasxfail") else "skipped"
    if outcome is not None:
        _record(report.nodeid, outcome, report.longrepr if report.failed else
                getattr(report, "wasxfail", "") or "")


_RANK = {"passed": 0, "xfail": 0, "skipped": 1, "xpass": 2, "failed": 3, "error": 4}


def _record(nodeid: str, outcome: str, message) -> None:
    prev = _tests.get(nodeid)
    if prev is not None and _RANK[prev[0]] >= _RANK[outcome]:
        return  # a test's phases: the worst one is its outcome
    _tests[nodeid] = (outcome, _cut(message))


def _flush(nodeid: str) -> None:
    global _sent
    entry = _tests.pop(nodeid, None)
    if entry is not None:
        _send({"e": "test", "id": _cut(nodeid), "o": entry[0], "m": entry[1]})
        _sent += 1


def pytest_runtest_logfinish(nodeid, location):
    _flush(nodeid)


@pytest.hookimpl(tryfirst=True)  # before any other plugin's, which might raise
def pytest_sessionfinish(session, exitstatus):
    for nodeid in list(_tests):
        _flush(nodeid)
    _send({"e": "finish", "n": _sent, "x": int(exitstatus)})
