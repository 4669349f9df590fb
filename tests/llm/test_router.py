"""`ReplicaRouter`: least outstanding tokens, prefix affinity (an episode's turns and a
group's episodes stay where their prefix is cached), and affinity given up when that
replica is too busy; `WeightFanout` reaches every replica."""

from __future__ import annotations

import threading

import pytest

from ridgeline.errors import ConfigError
from ridgeline.llm.base import Completion, Sampling
from ridgeline.llm.router import ReplicaRouter, WeightFanout, block_hashes


class Replica:
    """A generator that samples `n` fixed ids and can be held mid-request."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.context_window = 4096
        self.prompts: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.weights: list[int | None] = []

    def complete_ids(self, prompt_ids, sampling=None, tools=None) -> Completion:
        self.prompts.append(list(prompt_ids))
        self.gate.wait(10)
        ids = [7] * (sampling.max_tokens if sampling else 4)
        return Completion(text="", token_ids=ids, logprobs=[0.0] * len(ids))

    def update_weights(self, tensors, version=None) -> int:
        self.weights.append(version)
        return len(list(tensors))


def test_block_hashes_chain_over_full_blocks():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2 and block_hashes(list(range(32)), 16) == a
    assert block_hashes([99] + list(range(1, 40)), 16)[1] != a[1]   # the chain carries


def test_an_episodes_turns_stay_on_one_replica():
    reps = [Replica("a"), Replica("b"), Replica("c")]
    router = ReplicaRouter(reps, block_size=4, slack_tokens=10_000)
    s = Sampling(max_tokens=4)
    placed = {}
    for ep in range(6):                      # six episodes, three turns each
        prompt = [100 + ep] * 12
        for turn in range(3):
            c = router.complete_ids(prompt, s)
            placed.setdefault(ep, set()).add(
                next(k for k, r in enumerate(reps) if r.prompts and r.prompts[-1] == prompt))
            prompt = prompt + c.token_ids + [50 + turn] * 5
    assert all(len(v) == 1 for v in placed.values())
    # new episodes (no shared prefix) went to the least loaded: all replicas used
    assert {next(iter(v)) for v in placed.values()} == {0, 1, 2}
    assert router.metrics()["replica/0/affinity_hits"] >= 2


def test_requests_go_to_the_replica_with_the_fewest_outstanding_tokens():
    reps = [Replica("a"), Replica("b")]
    router = ReplicaRouter(reps, block_size=4)
    reps[0].gate.clear()                     # replica a holds its request
    t = threading.Thread(target=router.complete_ids, args=([1] * 8, Sampling(max_tokens=500)))
    t.start()
    while not reps[0].prompts:
        pass
    assert router.route([2] * 8, 10) == 1    # a has 508 outstanding tokens, b none
    reps[0].gate.set()
    t.join(5)
    assert router.replicas[0].outstanding == 0


def test_affinity_yields_to_load_beyond_the_slack():
    reps = [Replica("a"), Replica("b")]
    router = ReplicaRouter(reps, block_size=4, slack_tokens=100)
    shared = [5] * 16                        # a group's common first prompt
    first = router.route(shared, 20)
    assert router.route(shared, 20) == first  # within the slack: same replica (cached)
    for _ in range(3):
        router.route(shared, 20)
    # now 5 x 36 = 180 tokens outstanding there, over the slack: the next goes elsewhere
    assert router.route(shared, 20) != first


def test_weights_reach_every_replica_and_no_replica_is_an_error():
    reps = [Replica("a"), Replica("b")]
    assert WeightFanout(reps).update_weights([("w", None)], version=3) == 1
    assert [r.weights for r in reps] == [[3], [3]]
    with pytest.raises(ConfigError):
        ReplicaRouter([])
    with pytest.raises(ConfigError):
        WeightFanout([])


def test_known_hashes_continue_the_chain():
    ids = list(range(50))
    head = block_hashes(ids[:37], 8)
    assert block_hashes(ids, 8, known=head) == block_hashes(ids, 8)
