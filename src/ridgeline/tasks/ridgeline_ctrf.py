"""A pytest plugin writing a CTRF JSON report (`--ctrf FILE`), for test scripts that ask
for pytest-json-ctrf when that package is not on the machine. Stdlib only. The verifier
loads it into every pytest it starts (`PYTEST_PLUGINS`, after the task's own plugins;
`-p ridgeline_ctrf` from the offline uv), so a plain `pytest --ctrf FILE` works.

It registers `--ctrf` only when no other plugin did: a real pytest-json-ctrf loaded
before it (an entry point, `-p`) keeps the option and writes the report itself. The
report lists what this pytest ran, nothing else; the verdict never comes from it (the
verifier's reporter, ridgeline_report.py, is the record)."""

from __future__ import annotations

import json
import time
from pathlib import Path

OPTION = "--ctrf"
_STATE: dict = {"own": False}


def _registered(parser, name: str) -> bool:
    """Whether an option `name` is already on `parser` (any group), so adding it again
    would make pytest's argument parser refuse to start."""
    groups = [getattr(parser, "_anonymous", None), *getattr(parser, "_groups", [])]
    for group in groups:
        for opt in getattr(group, "options", []) if group is not None else []:
            try:
                if name in opt.names():
                    return True
            except Exception:  # noqa: BLE001 - an option object of another pytest
                continue
    return False


def pytest_addoption(parser):
    _STATE["own"] = not _registered(parser, OPTION)
    if _STATE["own"]:
        parser.addoption(OPTION, action="store", default=None, metavar="FILE",
                         help="write a CTRF JSON test report to FILE")


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
    if not _STATE["own"]:
        return              # the real plugin owns --ctrf and writes its own report
    path = session.config.getoption(OPTION)
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
