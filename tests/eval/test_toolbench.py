"""The tool-call benchmark: each task solvable through the tools, failing untouched."""

from __future__ import annotations

import pytest

from ridgeline.eval.toolbench.tasks import TOOL_TASKS, get_tool_task
from ridgeline.eval.toolbench.world import ToolUseError, World, call_tool, tool_specs
from ridgeline.errors import NotFoundError


def test_at_least_15_tasks_with_unique_ids():
    assert len(TOOL_TASKS) >= 15
    assert len({t.id for t in TOOL_TASKS}) == len(TOOL_TASKS)


@pytest.mark.parametrize("task", TOOL_TASKS, ids=lambda t: t.id)
def test_oracle_passes_and_untouched_fails(task):
    init = task.setup()
    solved = init.clone()
    task.oracle(solved)
    ok, reason = task.check(init, solved)
    assert ok, reason
    assert not task.check(init, init.clone())[0]


@pytest.mark.parametrize("tool,args,error", [
    ("buy", {"symbol": "ACME", "quantity": 3}, "insufficient cash"),
    ("get_price", {"symbol": "NOPE"}, "unknown symbol"),
    ("buy", {"symbol": "ACME", "quantity": 1.5}, "whole number"),
    ("buy", {"ticker": "ACME"}, "bad arguments"),
    ("rm_rf", {}, "unknown tool"),
], ids=["cash", "symbol", "quantity", "arguments", "tool"])
def test_tool_misuse_is_a_recoverable_error(tool, args, error):
    w = World(cash=10.0, prices={"ACME": 5.0})
    with pytest.raises(ToolUseError, match=error):
        call_tool(w, tool, args)
    assert w.cash == 10.0 and not w.positions  # nothing changed by the failed call


def test_tool_specs_are_json_schemas():
    specs = {s.name: s for s in tool_specs()}
    assert specs["buy"].parameters["required"] == ["symbol", "quantity"]
    assert specs["buy"].parameters["properties"]["quantity"]["type"] == "integer"
    assert "self" not in specs["get_cash"].parameters["properties"]


def test_unknown_task_id():
    with pytest.raises(NotFoundError):
        get_tool_task("nope")
