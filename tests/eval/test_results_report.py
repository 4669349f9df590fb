"""Scoring rules, pass@k and the report files."""

from __future__ import annotations

import json

import pytest

from ridgeline.eval.report import write_report
from ridgeline.eval.results import EpisodeResult, pass_at_k, summarize


def _ep(task, status, sample=0, domain="shell", steps=3, fc=None):
    return EpisodeResult(task_id=task, status=status, sample=sample, domain=domain, steps=steps,
                         failure_class=fc)


def test_pass_at_k_matches_closed_forms():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)
    with pytest.raises(ValueError):
        pass_at_k(1, 0, 2)


def test_infra_errors_and_unsupported_are_not_scored():
    res = [_ep("a", "passed"), _ep("b", "failed", fc="tests_failed"),
           _ep("c", "infra_error", fc="infra:setup"), _ep("d", "unsupported", fc="unsupported:docker")]
    s = summarize(res)
    assert (s.n_tasks, s.n_scored, s.n_passed, s.n_infra_error, s.n_unsupported) == (4, 2, 1, 1, 1)
    assert s.pass_rate == pytest.approx(0.5)
    assert s.failure_classes == {"infra": 1, "tests_failed": 1, "unsupported": 1}


def test_pass_at_k_over_samples_per_task():
    res = [_ep("a", "passed", 0), _ep("a", "failed", 1), _ep("b", "failed", 0), _ep("b", "failed", 1)]
    s = summarize(res, samples=2)
    assert s.pass_at_k["pass@1"] == pytest.approx(0.25)
    assert s.pass_at_k["pass@2"] == pytest.approx(0.5)


def test_report_files(tmp_path):
    res = [_ep("a", "passed", domain="git", steps=2), _ep("b", "failed", domain="shell", steps=7, fc="step_limit")]
    s = summarize(res, wall_s=1.5)
    paths = write_report(tmp_path, res, s, {"agent": "llm", "tasks": "builtin", "model": "default"})
    data = json.loads(paths["results"].read_text())
    assert data["summary"]["n_passed"] == 1 and len(data["episodes"]) == 2
    md = paths["report"].read_text()
    assert "pass rate: 50.0%" in md and "step_limit" in md and "pass_rate_by_domain.png" in md
    for name in ("pass_rate_by_domain", "steps_histogram"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
