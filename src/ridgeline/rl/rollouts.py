"""What a rollout produces and the single-turn one: a group of episodes of one task.

`EpisodeGroup` is what a rollout returns and the buffer holds; `protocols.GroupRollout`
is the interface (`TokenTaskRollout` here, `agent_rollout.AgentRollout` for agents in
task sandboxes). `TokenTaskRollout` samples completions of a `TokenTask` on the in-process
engine and scores them with a verifier that runs in a sandbox (`SandboxVerifier`: model
output is never evaluated on the host). A verifier that fails masks the group's episodes
(reward None, with a reason): an infrastructure failure never becomes a reward of 0.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ridgeline.engine import SamplingParams
from ridgeline.errors import RidgelineError
from ridgeline.rl.filters import EpisodeOutcome
from ridgeline.rl.protocols import JSONValue, RLTask
from ridgeline.rl.tokens import TokenEpisode
from ridgeline.tasks.verifier import VerdictStatus

if TYPE_CHECKING:
    from ridgeline.engine import LLM
    from ridgeline.sandbox import Sandbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenTask:
    """A single-turn verifiable task: a prompt of token ids and what the verifier needs
    to score a completion (JSON-able)."""

    id: str
    prompt_ids: list[int]
    answer: JSONValue


@dataclass
class EpisodeGroup:
    """One task's episodes (a GRPO group), as a rollout returns them and the buffer holds
    them. `index` is the task source's draw number (the checkpoint's data order)."""

    task: RLTask
    outcomes: list[EpisodeOutcome] = field(default_factory=list)
    seconds: float = 0.0
    index: int = -1
    tokens: int = 0        # tokens sampled for this group (throughput)

    @property
    def samples(self) -> list[TokenEpisode | None]:
        """Each episode's tokens (None for one without a token record: its outcome says
        why it is masked); what the buffer reads the weights versions from."""
        return [o.sample for o in self.outcomes]

    def __setstate__(self, state: dict[str, object]) -> None:
        # a group pickled in a checkpoint before `records` became `outcomes` (and
        # `samples` was stored beside them)
        if "records" in state:
            state = {k: v for k, v in state.items() if k != "samples"}
            state["outcomes"] = state.pop("records")
        self.__dict__.update(state)


class VerifierError(RidgelineError):
    """The verifier could not score a group (its episodes are masked, never rewarded 0)."""


class SandboxVerifier:
    """Scores completions with a Python program run in a sandbox. The program reads
    `[{"answer": ..., "completion": [ids...]}, ...]` as JSON on stdin and prints a JSON
    list of rewards (numbers, or null for "cannot score")."""

    def __init__(self, script: str, sandbox: Sandbox | None = None,
                 timeout_s: float = 30.0) -> None:
        from ridgeline.sandbox import SandboxSpec, create_sandbox

        self.script = script
        self.timeout_s = timeout_s
        self._own = sandbox is None
        self.sandbox = sandbox or create_sandbox(SandboxSpec())
        self._lock = threading.Lock()  # one command at a time per sandbox

    def __call__(self, task: TokenTask, completions: list[list[int]]) -> list[float | None]:
        payload = json.dumps([{"answer": task.answer, "completion": c} for c in completions])
        with self._lock:
            res = self.sandbox.run(["python3", "-I", "-c", self.script],
                                   stdin=payload.encode(), timeout=self.timeout_s)
        if not res.ok:
            raise VerifierError(f"verifier exited {res.exit_code}: {res.stderr.strip()[-300:]}")
        try:
            rewards = json.loads(res.stdout)
        except ValueError:
            raise VerifierError(f"verifier printed no JSON: {res.stdout[-200:]!r}") from None
        if not isinstance(rewards, list) or len(rewards) != len(completions):
            raise VerifierError(f"verifier gave {rewards!r} for {len(completions)} completions")
        return [None if r is None else float(r) for r in rewards]

    def close(self) -> None:
        if self._own:
            self.sandbox.close()


Reward = Callable[[TokenTask, list[list[int]]], Sequence[float | None]]


class TokenTaskRollout:
    """Single-turn groups of a `TokenTask` on the in-process engine, scored by `reward`
    (e.g. a `SandboxVerifier`)."""

    def __init__(self, llm: LLM, reward: Reward, *, max_tokens: int = 16,
                 temperature: float = 1.0) -> None:
        self.llm = llm
        self.reward = reward
        self.max_tokens = max_tokens
        self.temperature = temperature

    def __call__(self, task: TokenTask, seeds: list[int]) -> EpisodeGroup:
        t0 = time.perf_counter()
        reqs = [(self.llm.new_request_id("rl"), task.prompt_ids,
                 SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens,
                                ignore_eos=True, seed=seed, logprobs_mode="tempered"))
                for seed in seeds]
        samples = []
        for handle in self.llm.worker.submit_many(reqs):
            c = handle.result().outputs[0]
            ep = TokenEpisode.start(task.prompt_ids)
            ep.add_completion(c.token_ids, c.logprobs, c.token_versions)
            samples.append(ep)
        try:
            rewards = list(self.reward(task, [s.token_ids[len(task.prompt_ids):]
                                              for s in samples]))
            verdict, detail = VerdictStatus.PASSED.value, ""
        except Exception as e:  # noqa: BLE001 - a broken verifier masks, never scores 0
            log.warning("verifier failed on task %s: %s", task.id, e)
            rewards, detail = [None] * len(samples), str(e)[:300]
            verdict = VerdictStatus.INFRA_ERROR.value
        outcomes = [EpisodeOutcome(verdict=verdict, reward=r, sample=ep, detail=detail)
                    for ep, r in zip(samples, rewards)]
        return EpisodeGroup(task, outcomes, time.perf_counter() - t0,
                            tokens=sum(s.num_policy_tokens for s in samples))


def passed(outcome: EpisodeOutcome) -> bool:
    """An episode counts as a pass when it is graded and earned the full reward."""
    return (outcome.verdict == VerdictStatus.PASSED and outcome.reward is not None
            and outcome.reward >= 1.0)
