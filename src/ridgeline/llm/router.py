"""`ReplicaRouter`: token-in generation spread over several engine replicas (in-process
`EngineClient`s or `OpenAIClient`s on separate servers), by least outstanding tokens with
prefix affinity.

    router = ReplicaRouter([EngineClient(llm_a), EngineClient(llm_b)])
    router.complete_ids(prompt_ids, sampling)    # as a single replica would answer

Each replica remembers (in a bounded LRU) the chained hashes of the full blocks of every
sequence it served, prompt and sampled ids. A request goes to the replica holding the
longest run of its leading blocks, where that prefix is in the KV cache already: the
turns of an agent episode (each prompt extends the last one) stay on one replica, and so
do the episodes of a GRPO group, which share their first prompt. Unless that replica is
busier than the least loaded one by more than `slack_tokens` outstanding tokens (prompt
plus `max_tokens` of the requests in flight): then the request goes to the least loaded
replica, so affinity cannot pile every group onto one engine.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ridgeline.errors import ConfigError
from ridgeline.llm.base import Completion, Sampling, ToolSpec


def block_hashes(ids: Sequence[int], block_size: int, known: Sequence[int] = ()) -> list[int]:
    """Chained hashes of the full blocks of `ids` (each covers the whole prefix);
    `known`: the hashes of its first blocks, already computed (they are not redone)."""
    out = list(known)
    parent = out[-1] if out else 0
    for start in range(len(out) * block_size, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start:start + block_size])))
        out.append(parent)
    return out


class _Replica:
    def __init__(self, generator: Any, capacity: int) -> None:
        self.generator = generator
        self.capacity = capacity
        self.outstanding = 0       # prompt + max_tokens of the requests in flight
        self.requests = 0
        self.affinity_hits = 0
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of the request this replica served before."""
        for n in range(len(hashes), 0, -1):  # chained: the deepest hit implies the rest
            if hashes[n - 1] in self._blocks:
                return n
        return 0

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class ReplicaRouter:
    def __init__(self, replicas: Sequence[Any], *, block_size: int = 16,
                 slack_tokens: int = 4096, remembered_blocks: int = 200_000) -> None:
        if not replicas:
            raise ConfigError("a router needs at least one replica")
        self.replicas = [_Replica(g, remembered_blocks) for g in replicas]
        self.block_size = block_size
        self.slack_tokens = slack_tokens
        self._lock = threading.Lock()
        self.name = "router(" + ", ".join(str(r.generator.name) for r in self.replicas) + ")"
        self.supports_tools = all(getattr(r.generator, "supports_tools", False)
                                  for r in self.replicas)

    @property
    def context_window(self) -> int:
        return min(r.generator.context_window for r in self.replicas)

    def route(self, prompt_ids: Sequence[int], max_tokens: int) -> int:
        """The replica index a request of `prompt_ids` goes to (and counts it there)."""
        return self._route(block_hashes(prompt_ids, self.block_size),
                           len(prompt_ids) + max_tokens)

    def _route(self, hashes: list[int], cost: int) -> int:
        with self._lock:
            least = min(range(len(self.replicas)),
                        key=lambda k: (self.replicas[k].outstanding, self.replicas[k].requests))
            best, depth = least, 0
            for k, r in enumerate(self.replicas):
                n = r.matched(hashes)
                if n > depth:
                    best, depth = k, n
            chosen = least
            if depth > 0 and (self.replicas[best].outstanding
                              <= self.replicas[least].outstanding + self.slack_tokens):
                chosen = best
                self.replicas[best].affinity_hits += 1
            r = self.replicas[chosen]
            r.outstanding += cost
            r.requests += 1
            r.remember(hashes)
            return chosen

    def complete_ids(self, prompt_ids: list[int], sampling: Sampling | None = None,
                     tools: list[ToolSpec] | None = None) -> Completion:
        sampling = sampling or Sampling()
        hashes = block_hashes(prompt_ids, self.block_size)
        cost = len(prompt_ids) + sampling.max_tokens
        r = self.replicas[self._route(hashes, cost)]
        try:
            completion = r.generator.complete_ids(prompt_ids, sampling, tools)
        finally:
            with self._lock:
                r.outstanding -= cost
        sampled = completion.token_ids or []
        with self._lock:  # the sampled blocks are in that replica's cache now too
            r.remember(block_hashes(list(prompt_ids) + list(sampled), self.block_size,
                                    known=hashes)[len(hashes):])
        return completion

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {}
            for k, r in enumerate(self.replicas):
                out[f"replica/{k}/requests"] = float(r.requests)
                out[f"replica/{k}/outstanding_tokens"] = float(r.outstanding)
                out[f"replica/{k}/affinity_hits"] = float(r.affinity_hits)
            return out


class WeightFanout:
    """`update_weights` to every replica (each an `EngineWorker` or `RemoteWeights`):
    what `PolicyTrainer.sync` calls when rollouts run on several engines."""

    def __init__(self, targets: Sequence[Any]) -> None:
        if not targets:
            raise ConfigError("no replica to send weights to")
        self.targets = list(targets)

    def update_weights(self, named_tensors: Any, version: int | None = None) -> int:
        tensors = list(named_tensors)
        counts = [t.update_weights(tensors, version=version) for t in self.targets]
        return min(counts)

    def close(self) -> None:
        for t in self.targets:
            close = getattr(t, "close", None)
            if close is not None:
                close()
