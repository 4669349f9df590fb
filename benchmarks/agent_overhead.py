"""The agent loop's own cost per step, excluding the model call and the command.

    .venv/bin/python benchmarks/agent_overhead.py            # ~10 s, prints one JSON object
    .venv/bin/python benchmarks/agent_overhead.py --steps 400 --backend bwrap

Workload: episodes of a replay model that answers instantly (every reply a short thought
and one action, cycling bash / write_file / read_file / edit, both action formats), in a
real sandbox, with the JSONL trajectory written after every step. The model reports
prompt token ids as long as its prompt (up to ~3k tokens), as a real engine does, so the
trajectory writes are realistically large; its context window (4096) forces periodic
condensation. Per step, `overhead = total - model call - action execution - condensation`
(the loop's parsing, observation formatting, history upkeep, token counting, record
building and writing). Baseline in the same run: the execution time of the cheapest
command (`true`) in the same persistent shell; the ratio says how the loop compares
with one round trip to the sandbox. Goal: median overhead < 5 ms.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import tempfile
import warnings
from datetime import date
from pathlib import Path

from bench_common import machine

from ridgeline.agent import AgentConfig, run_agent
from ridgeline.llm.base import Completion, Message, Sampling, ToolCall, ToolSpec, Usage
from ridgeline.sandbox import SandboxSpec, create_sandbox

TEXT_ACTIONS = [
    "Now I check the files.\n```bash\ntrue\n```",
    'Write the notes.\n<write_file path="notes.txt">\nline one\nline two\n</write_file>',
    'Read them back.\n<read_file path="notes.txt"/>',
    'Fix a line.\n<edit path="notes.txt"><old>line two</old><new>line 2</new></edit>',
    'Restore it.\n<edit path="notes.txt"><old>line 2</old><new>line two</new></edit>',
]
NATIVE_ACTIONS = [
    ("bash", {"command": "true"}),
    ("write_file", {"path": "notes.txt", "content": "line one\nline two\n"}),
    ("read_file", {"path": "notes.txt"}),
    ("edit", {"path": "notes.txt", "old": "line two", "new": "line 2"}),
    ("edit", {"path": "notes.txt", "old": "line 2", "new": "line two"}),
]


class ReplayModel:
    """Answers at once from a cycle of replies; counts 4 characters as a token."""

    def __init__(self, steps: int, native: bool, context_window: int = 4096) -> None:
        self.steps = steps
        self.native = native
        self.supports_tools = native
        self.context_window = context_window
        self.name = "replay"
        self.n = 0

    def count_tokens(self, messages: list[Message]) -> int:
        return sum(math.ceil(len(m.content) / 4) + 4 for m in messages)

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        prompt = self.count_tokens(messages)
        if messages[0].content.startswith("You summarise"):
            return Completion(text="notes", usage=Usage(prompt_tokens=prompt, completion_tokens=2))
        self.n += 1
        i = self.n % len(TEXT_ACTIONS)
        if self.n >= self.steps:
            text, calls = "<finish/>", []
            if self.native:
                text, calls = "", [ToolCall(id=f"c{self.n}", name="finish")]
        elif self.native:
            name, args = NATIVE_ACTIONS[i]
            text, calls = "Next step.", [ToolCall(id=f"c{self.n}", name=name, arguments=args)]
        else:
            text, calls = TEXT_ACTIONS[i], []
        n_out = max(1, len(text) // 4)
        return Completion(text=text, tool_calls=calls, finish_reason="stop",
                          prompt_token_ids=list(range(prompt)), token_ids=list(range(n_out)),
                          logprobs=[-0.25] * n_out,
                          usage=Usage(prompt_tokens=prompt, completion_tokens=n_out))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps per episode and format")
    ap.add_argument("--backend", default="local", choices=["local", "bwrap"])
    args = ap.parse_args()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sandbox = create_sandbox(SandboxSpec(), backend=args.backend)
    overhead: dict[str, list[float]] = {}
    n_condensations = 0
    try:
        shell = sandbox.shell()
        baseline = [shell.send("true").duration_s for _ in range(50)]
        shell.close()
        config = AgentConfig(step_limit=args.steps + 5, summary_by_model=True)
        with tempfile.TemporaryDirectory() as tmp:
            for native in (False, True):
                fmt = "tool_calls" if native else "text"
                episode = run_agent("Keep notes in notes.txt.", sandbox,
                                    ReplayModel(args.steps, native), config,
                                    trajectory_path=Path(tmp) / f"{fmt}.jsonl")
                assert episode.result.status.value == "finished", episode.result.error
                steps = episode.trajectory.steps
                assert all(s.observation is None or s.observation.ok for s in steps)
                n_condensations += episode.result.n_condensations
                overhead[fmt] = [s.timings.overhead_s * 1000 for s in steps]
    finally:
        sandbox.close()

    every = overhead["text"] + overhead["tool_calls"]
    base_ms = statistics.median(baseline) * 1000
    median = statistics.median(every)
    print(json.dumps({
        "benchmark": "agent_overhead",
        "date": date.today().isoformat(),
        "machine": machine(arch=platform.machine(), os=platform.system()),
        "sandbox_backend": args.backend,
        "steps": len(every),
        "condensations": n_condensations,
        "overhead_ms": {"median": round(median, 3), "p90": round(pct(every, 0.9), 3),
                        "p99": round(pct(every, 0.99), 3), "mean": round(statistics.mean(every), 3),
                        "max": round(max(every), 3)},
        "overhead_median_ms_by_format": {k: round(statistics.median(v), 3) for k, v in overhead.items()},
        "baseline_shell_true_ms": round(base_ms, 3),
        "overhead_vs_baseline": round(median / base_ms, 3) if base_ms else None,
        "goal_ms": 5.0,
        "meets_goal": median < 5.0,
    }, indent=2))


if __name__ == "__main__":
    main()
