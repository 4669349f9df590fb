"""The JSONL trajectory: written as the episode goes, loaded back whole."""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from pathlib import Path

import pytest

from ridgeline.agent import AgentResult, ExitStatus, Trajectory
from ridgeline.agent.trajectory import (
    StepRecord, TrajectoryHeader, TrajectoryResult, TrajectoryWriter,
)
from ridgeline.errors import NotFoundError, RidgelineError
from ridgeline.llm.base import Message


class Status(str, Enum):
    PASSED = "passed"


@dataclasses.dataclass
class Verdict:
    status: Status
    tests_passed: int
    tests_total: int


def test_written_step_by_step_and_loaded_back(tmp_path: Path) -> None:
    path = tmp_path / "t" / "episode.jsonl"
    w = TrajectoryWriter(path, TrajectoryHeader(task_id="t1", instruction="do", agent="llm",
                                                messages=[Message(role="user", content="do")]))
    w.step(StepRecord(index=1, started_at=0.0, response=Message(role="assistant", content="a"),
                      prompt_token_ids=[1, 2], completion_token_ids=[3], logprobs=[-0.1]))
    # After a step the file already holds it (a crash keeps what happened).
    assert [json.loads(line)["type"] for line in path.read_text().splitlines()] == ["header", "step"]
    w.step(StepRecord(index=2, started_at=1.0, response=Message(role="assistant", content="b")))
    traj = w.finish(TrajectoryResult(status=ExitStatus.STEP_LIMIT, steps=2))
    episode = AgentResult(traj, path)
    assert episode.result is traj.result and episode.result.total_tokens == 0
    episode.attach_verdict(Verdict(Status.PASSED, 3, 4))

    loaded = Trajectory.load(path)
    assert loaded == episode.trajectory
    assert loaded.verdict == {"status": "passed", "tests_passed": 3, "tests_total": 4}
    assert loaded.result is not None and loaded.result.status is ExitStatus.STEP_LIMIT
    (turn,) = loaded.turns()  # only step 1 had token ids
    assert (turn.step, turn.prompt_token_ids, turn.completion_token_ids, turn.logprobs) == (1, [1, 2], [3], [-0.1])

    copy = tmp_path / "copy.jsonl"
    loaded.save(copy)
    assert Trajectory.load(copy) == loaded


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        Trajectory.load(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "header", "task_id": "t", "instruction": "i", "agent": "a"}\nnot json\n')
    with pytest.raises(RidgelineError, match="bad.jsonl:2"):
        Trajectory.load(bad)
    (tmp_path / "nohead.jsonl").write_text("")
    with pytest.raises(RidgelineError, match="no header"):
        Trajectory.load(tmp_path / "nohead.jsonl")
