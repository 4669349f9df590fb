"""An episode stopped after any step and continued from `Episode.state()` in a new
`Episode` (as a platform worker does after a crash) ends exactly like one uninterrupted
run: the same prompts, the same step numbers, the same final history."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripted_model import ScriptedModel
from ridgeline.agent import AgentConfig, InstructionTask
from ridgeline.agent.loop import Agent, Episode
from ridgeline.agent.tools import Workbench
from ridgeline.agent.trajectory import ExitStatus
from ridgeline.errors import RidgelineError
from ridgeline.sandbox import Sandbox

SCRIPT = [
    "```bash\necho one > a.txt\n```",
    "no action here",                       # a format error: counted and replayed
    "```bash\ncat a.txt; echo two >> a.txt\n```",
    "```bash\ncat a.txt\n```",
    "<finish>done</finish>",
]


class Stop(Exception):
    pass


def episode(sandbox: Sandbox, script: list[str], on_step=None) -> tuple[Episode, ScriptedModel]:
    model = ScriptedModel(list(script))
    agent = Agent(model, AgentConfig(step_limit=20))
    ep = Episode(agent, InstructionTask("write a.txt"), Workbench(sandbox, 4000), None,
                 on_step=on_step)
    return ep, model


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4])
def test_resumed_episode_matches_an_uninterrupted_one(sandbox: Sandbox, stop_after: int,
                                                      tmp_path) -> None:
    whole, whole_model = episode(sandbox, SCRIPT)
    expected = whole.run()
    sandbox.run("rm -f a.txt")

    saved: dict = {}

    def stop(ep: Episode, record) -> None:
        if record.index == stop_after:
            saved["state"] = json.loads(json.dumps(ep.state()))  # must survive JSON
            raise Stop

    first, _ = episode(sandbox, SCRIPT, on_step=stop)
    with pytest.raises(Stop):
        first.run()
    second, model = episode(sandbox, SCRIPT[stop_after:])
    second.load_state(saved["state"])
    result = second.run()

    assert result.result.status is ExitStatus.FINISHED == expected.result.status
    assert result.result.steps == expected.result.steps == len(SCRIPT)
    assert result.result.n_format_errors == expected.result.n_format_errors == 1
    assert [s.index for s in result.trajectory.steps] == list(range(stop_after + 1, 6))
    assert [m.model_dump() for m in result.result.messages] == \
        [m.model_dump() for m in expected.result.messages]
    assert model.prompts == whole_model.prompts[stop_after:]


def test_on_step_sees_the_finishing_step(sandbox: Sandbox) -> None:
    seen = []
    ep, _ = episode(sandbox, ["<finish>ok</finish>"], on_step=lambda e, r: seen.append(r.index))
    assert ep.run().result.status is ExitStatus.FINISHED and seen == [1]


def test_unknown_checkpoint_version_is_refused(sandbox: Sandbox) -> None:
    ep, _ = episode(sandbox, SCRIPT)
    state = ep.state() | {"version": 99}
    with pytest.raises(RidgelineError, match="checkpoint version"):
        ep.load_state(state)
