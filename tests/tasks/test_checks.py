"""Quality checks: oracle passes every run, untouched environment fails; cached results
keep failing tasks out of evaluation sets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ridgeline.tasks import VerdictStatus, cached_check, check_task, load_task, load_tasks

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("RIDGELINE_CACHE_DIR", str(d))
    return d


def copy(tmp_path: Path, name: str, dest: str | None = None) -> Path:
    d = tmp_path / "suite" / (dest or name)
    shutil.copytree(FIXTURES / name, d)
    return d


def test_good_task_passes(tmp_path):
    c = check_task(load_task(copy(tmp_path, "tb1-hello-world")), runs=2)
    assert c.ok and c.reasons == []
    assert c.oracle_passes == 2 and len(c.oracle) == 2
    assert c.null.status is VerdictStatus.FAILED
    assert {"setup_s", "oracle_s", "verify_s", "total_s"} <= set(c.timings)
    assert all(v >= 0 for v in c.timings.values())


def test_wrong_oracle_is_flagged(tmp_path):
    d = copy(tmp_path, "tb1-hello-world", "wrong-oracle")
    (d / "solution.sh").write_text("#!/bin/bash\necho 'Goodbye' > hello.txt\n")
    c = check_task(load_task(d), runs=2)
    assert not c.ok and c.oracle_passes == 0
    assert any(r.startswith("oracle run 1/2: failed") for r in c.reasons)


def test_tests_that_pass_untouched_are_flagged(tmp_path):
    d = copy(tmp_path, "tb1-hello-world", "always-passes")
    (d / "tests" / "test_outputs.py").write_text("def test_nothing():\n    assert True\n")
    c = check_task(load_task(d), runs=1)
    assert not c.ok
    assert "the untouched environment already passes the tests" in c.reasons


def test_unsupported_task_is_flagged(tmp_path):
    c = check_task(load_task(FIXTURES / "broken" / "tb1-unsupported-image"), runs=3)
    assert not c.ok and c.unsupported and c.oracle == []
    assert "postgres" in c.reasons[0]


def test_missing_solution_is_flagged(tmp_path):
    d = copy(tmp_path, "tb1-hello-world", "no-solution")
    (d / "solution.sh").unlink()
    c = check_task(load_task(d), runs=1)
    assert not c.ok and any("no oracle solution" in r for r in c.reasons)


def test_cache_and_only_valid(tmp_path, cache):
    good = copy(tmp_path, "harbor-hello", "good")
    bad = copy(tmp_path, "harbor-hello", "bad")
    (bad / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    valid = load_tasks(tmp_path / "suite", only_valid=True)
    assert [t.id for t in valid] == ["good"]
    assert len(list((cache / "task-checks").glob("*.json"))) == 2
    cached = cached_check(load_task(good))
    assert cached is not None and cached.ok and cached.oracle_passes == 3
    assert cached.oracle[0].status is VerdictStatus.PASSED
    # editing a task invalidates its cached result
    (good / "instruction.md").write_text("Create hello.txt, please.\n")
    assert cached_check(load_task(good)) is None


def test_an_oracle_whose_verdicts_differ_between_runs_is_flaky(tmp_path, monkeypatch):
    """Differing verdicts over fresh environments: left out, with the reason first."""
    from ridgeline.tasks import checks
    from ridgeline.tasks.verifier import Verdict

    real = checks._episode
    calls = iter(range(100))

    def alternating(task, backend, oracle):
        verdict, times, note = real(task, backend, oracle)
        if oracle and next(calls) % 2:     # every second oracle run: as if a race lost
            verdict = Verdict(status=VerdictStatus.FAILED, reason="tests_failed",
                              detail="1 failed")
        return verdict, times, note

    monkeypatch.setattr(checks, "_episode", alternating)
    c = check_task(load_task(copy(tmp_path, "tb1-hello-world")), runs=3)
    assert c.flaky and not c.ok and c.oracle_passes == 2
    assert c.reasons[0] == "flaky: the oracle passed 2 of 3 runs"
    steady = check_task(load_task(copy(tmp_path, "tb1-hello-world", "steady")), runs=1)
    assert not steady.flaky
