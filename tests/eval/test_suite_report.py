"""`eval` on a suite of other people's tasks (issue 28): a broken task is reported and
skipped, and the pass rate over all tasks stands beside the one over scored episodes,
with the unsupported and broken tasks listed with their reasons."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ridgeline.eval.cli import register
from ridgeline.eval.report import render_markdown
from ridgeline.eval.results import EpisodeResult, summarize_suite
from ridgeline.eval.runner import EvalConfig, run_eval
from ridgeline.tasks.loader import BrokenTask

FIXTURES = Path(__file__).resolve().parents[1] / "tasks" / "fixtures"


def suite(root: Path) -> Path:
    """One task that runs, two this machine cannot run, one that does not load."""
    shutil.copytree(FIXTURES / "tb1-hello-world", root / "good")
    for name in ("other-parser-a", "other-parser-b"):
        shutil.copytree(FIXTURES / "tb1-hello-world", root / name)
        spec = root / name / "task.yaml"
        spec.write_text(spec.read_text() + "\nparser_name: swebench\n")
    (root / "broken").mkdir()
    (root / "broken" / "task.yaml").write_text("instruction: [unclosed\n")
    return root


def test_summary_of_a_mostly_unsupported_suite():
    res = [EpisodeResult(task_id="a", status="passed")]
    res += [EpisodeResult(task_id=f"u{i}", status="unsupported", detail=f"needs thing {i}",
                          failure_class=f"unsupported:needs thing {i}") for i in range(12)]
    s = summarize_suite(res, broken=[BrokenTask("b", Path("/x/b"), "invalid YAML")])
    assert s.pass_rate == 1.0 and s.pass_rate_supported == 1.0
    assert s.pass_rate_all == pytest.approx(1 / 14)
    assert (s.n_unsupported, s.n_broken) == (12, 1)
    assert s.unsupported_tasks["u3"] == "needs thing 3" and s.broken_tasks == {
        "b": "invalid YAML"}
    md = render_markdown(res, s, {"agent": "oracle", "samples": 1}, [])
    assert "pass rate over all tasks: 7.1%" in md and "pass rate: 100.0%" in md
    assert "| b | broken | invalid YAML |" in md and "| u3 | unsupported | needs thing 3 |" \
        in md


def test_eval_runs_the_rest_and_reports_what_did_not_run(tmp_path):
    root = suite(tmp_path / "suite")
    run = run_eval(EvalConfig(tasks=str(root), agent="oracle", concurrency=3,
                              out=tmp_path / "out"))
    s = run.summary
    assert (s.n_passed, s.n_scored, s.n_unsupported, s.n_broken) == (1, 1, 2, 1)
    assert s.pass_rate == 1.0 and s.pass_rate_all == pytest.approx(0.25)
    assert set(s.unsupported_tasks) == {"other-parser-a", "other-parser-b"}
    assert "swebench" in s.unsupported_tasks["other-parser-a"]
    assert "invalid YAML" in s.broken_tasks["broken"]
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["summary"]["pass_rate_all"] == pytest.approx(0.25)
    assert "invalid YAML" in data["summary"]["broken_tasks"]["broken"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "pass rate over all tasks: 25.0%" in md and "| broken | broken |" in md


def test_eval_cli_shows_both_rates_and_the_reasons(tmp_path):
    root = suite(tmp_path / "suite")
    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(app, ["eval", "--tasks", str(root), "--agent", "null",
                                 "--task", "broken", "--task", "other-parser-a",
                                 "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "pass rate over all tasks 0.0%" in r.output
    assert "unsupported other-parser-a:" in r.output and "swebench" in r.output
    assert "broken broken:" in r.output and "invalid YAML" in r.output
    r = CliRunner().invoke(app, ["eval", "--tasks", str(root), "--agent", "null",
                                 "--task", "other-parser-b", "--json",
                                 "--out", str(tmp_path / "out2")])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert out["pass_rate_all"] == 0.0 and out["n_broken"] == 0
    assert list(out["unsupported_tasks"]) == ["other-parser-b"]


def test_the_run_says_how_dockerfile_tasks_were_made(monkeypatch):
    from ridgeline.eval.runner import task_environment
    monkeypatch.setenv("RIDGELINE_TASK_ENV", "host")
    assert task_environment("bwrap") == "host (fallback: asked for), no internet"
    monkeypatch.setenv("RIDGELINE_TASK_INTERNET", "allow")
    assert task_environment("bwrap").endswith("internet for tasks that allow it")
    monkeypatch.setenv("RIDGELINE_TASK_ENV", "auto")
    assert task_environment("local").startswith("host (fallback:")
