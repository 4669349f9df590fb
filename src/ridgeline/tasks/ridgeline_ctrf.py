"""A pytest plugin writing a CTRF JSON report (`--ctrf FILE`), for Harbor test scripts
that ask for pytest-json-ctrf when that package is not on the machine. Stdlib only: it
is loaded with `-p ridgeline_ctrf` by the offline uv (see offline_tools.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def pytest_addoption(parser):
    parser.addoption("--ctrf", action="store", default=None, metavar="FILE",
                     help="write a CTRF JSON test report to FILE")


_STATE: dict = {}


def pytest_configure(config):
    _STATE.update(start=int(time.time() * 1000), tests={})


def pytest_runtest_logreport(report):
    tests = _STATE.setdefault("tests", {})
    entry = tests.setdefault(report.nodeid, {"name": report.nodeid, "status": "passed",
                                             "duration": 0})
    entry["duration"] += int(report.duration * 1000)
    if report.failed:
        entry["status"] = "failed"
        entry["message"] = str(report.longrepr)[-2000:] if report.longrepr else ""
    elif report.skipped and entry["status"] != "failed":
        entry["status"] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    path = config.getoption("--ctrf")
    state = _STATE
    if not path or "tests" not in state:
        return
    tests = list(state["tests"].values())
    counts = {k: sum(t["status"] == k for t in tests) for k in ("passed", "failed",
                                                                  "skipped", "pending")}
    summary = {"tests": len(tests), **counts,
               "other": len(tests) - sum(counts.values()),
               "start": state["start"], "stop": int(time.time() * 1000)}
    report = {"results": {"tool": {"name": "pytest"}, "summary": summary, "tests": tests}}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
