"""Per-test results from pytest's console output (the `-rA` short test summary)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    XFAIL = "xfail"
    XPASS = "xpass"


@dataclass(frozen=True)
class TestResult:
    name: str              # node id, e.g. tests/test_outputs.py::test_file_exists
    outcome: Outcome
    message: str = ""

    __test__ = False       # not a pytest test class, despite the name

    @property
    def ok(self) -> bool:
        return self.outcome in (Outcome.PASSED, Outcome.XFAIL)


_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+\s*$")
_SECTION = re.compile(r"^=+ .* =+\s*$")
_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(.*?)\s*$")
_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")
_FINAL = re.compile(r"^=+ (.*\bin [\d.]+s.*) =+\s*$")


def parse_pytest_output(text: str) -> list[TestResult]:
    """Every result line of every short-test-summary section in `text` (a script may run
    pytest several times). Without a summary section (no `-rA`), the per-test lines of
    `-v` output are used. Returns [] when pytest never reported on a test."""
    results: list[TestResult] = []
    in_summary = False
    for raw in text.splitlines():
        line = _strip_ansi(raw)
        if _SUMMARY_HEADER.match(line):
            in_summary = True
            continue
        if in_summary and _SECTION.match(line):
            in_summary = False
            continue
        if in_summary and (m := _LINE.match(line)):
            word, rest = m.groups()
            results.append(_result(Outcome(word.lower()), rest))
    if results:
        return results
    verbose = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
    for raw in text.splitlines():
        if m := verbose.match(_strip_ansi(raw)):
            results.append(TestResult(m.group(1), Outcome(m.group(2).lower())))
    return results


def summary_counts(text: str) -> dict[str, int]:
    """Counts from pytest's final line (`=== 2 failed, 3 passed in 0.1s ===`), summed over
    every session in `text`."""
    counts: dict[str, int] = {}
    for raw in text.splitlines():
        if m := _FINAL.match(_strip_ansi(raw)):
            for n, word in _COUNTS.findall(m.group(1)):
                key = "error" if word.startswith("error") else word
                counts[key] = counts.get(key, 0) + int(n)
    return counts


def _result(outcome: Outcome, rest: str) -> TestResult:
    if outcome is Outcome.SKIPPED:
        # `SKIPPED [1] tests/test_x.py:12: reason`
        m = re.match(r"^\[\d+\]\s+(\S+?:\d+):\s*(.*)$", rest)
        if m:
            return TestResult(m.group(1), outcome, m.group(2))
        return TestResult(rest, outcome)
    name, sep, message = rest.partition(" - ")
    return TestResult(name.strip(), outcome, message.strip() if sep else "")


def _strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)
