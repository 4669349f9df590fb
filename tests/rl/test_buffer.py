"""The staleness-bounded rollout buffer: admission control, oldest-first batches that never
leave a due group behind, no sample dropped, close(), checkpoints.

Ordering between threads is made with events and the buffer's own state (a call with a
short timeout that must return None is decided by the buffer's counters, not by timing),
so the tests do not depend on how loaded the machine is."""

from __future__ import annotations

import json
import pickle
import random
import threading
import time
from dataclasses import dataclass

import pytest

from ridgeline.errors import ConfigError
from ridgeline.rl.buffer import (
    BufferClosed, RolloutBuffer, StalenessError, Ticket, group_versions, sample_versions,
)

SHORT = 0.02   # a wait that must time out: the buffer's state decides, not the clock
LONG = 10.0    # a wait that must succeed; a deadlock fails instead of hanging


@dataclass
class Ep:
    """Like TokenEpisode: one version per token, -1 on tokens the policy did not sample."""

    versions: list[int]
    reward: float = 0.0


@dataclass
class Grp:
    samples: list[Ep]
    gid: int = -1


def grp(version: int, gid: int = -1, n: int = 2) -> Grp:
    return Grp([Ep([-1, -1, version, version]) for _ in range(n)], gid)


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(LONG)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"


# -- versions of the caller's objects --------------------------------------------------------


def test_versions_from_attributes_mappings_and_sequences() -> None:
    assert sample_versions(Ep([-1, 3, 4, -1])) == [3, 4]
    assert sample_versions({"version": 2}) == [2]
    assert sample_versions({"versions": [None, 1]}) == [1]
    assert group_versions(Grp([Ep([0, 1]), Ep([1])])) == [0, 1, 1]
    assert group_versions([{"version": 5}, {"version": 6}]) == [5, 6]
    assert group_versions({"samples": [{"version": 1}]}) == [1]
    with pytest.raises(TypeError, match="version"):
        sample_versions(object())


def test_bad_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        RolloutBuffer(0)
    with pytest.raises(ConfigError):
        RolloutBuffer(2, eta=-1)


# -- admission ---------------------------------------------------------------------------------


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_admits_exactly_eta_plus_one_batches_ahead(eta: int) -> None:
    B = 3
    buf = RolloutBuffer(B, eta=eta)
    tickets = [buf.admit(timeout=0) for _ in range((eta + 1) * B)]
    assert all(t is not None and t.version == 0 and t.deadline == eta for t in tickets)
    assert buf.admit(timeout=SHORT) is None          # one more would be consumed too late
    for t in tickets:
        buf.put(grp(0), t)
    assert buf.admit(timeout=0) is None              # finishing does not free a slot
    assert len(buf.get_batch(B, timeout=0)) == B
    assert buf.admit(timeout=0) is None              # nor does taking a batch...
    assert buf.publish_version() == 1                # ...publishing the next version does
    more = [buf.admit(timeout=0) for _ in range(B)]
    assert all(t is not None and t.version == 1 for t in more)
    assert buf.admit(timeout=SHORT) is None
    m = buf.metrics()
    assert m["admit_timeouts"] == 4 and m["groups_in_flight"] == B
    assert m["groups_ready"] == eta * B and m["started"] == (eta + 2) * B


def test_eta0_nothing_starts_while_the_step_trains() -> None:
    buf = RolloutBuffer(2, eta=0)
    a, b = buf.admit(0), buf.admit(0)
    assert buf.admit(timeout=SHORT) is None
    buf.put(grp(0), a)
    buf.put(grp(0), b)
    assert buf.get_batch(timeout=0) is not None
    assert not buf.can_admit() and buf.admit(timeout=SHORT) is None   # training step 0
    buf.publish_version()
    assert buf.admit(timeout=0).version == 1


def test_eta0_threads_strictly_synchronous() -> None:
    """Producers on threads: every group consumed at step k was started under version k,
    after version k was published, and no rollout runs while a step trains."""
    B, P, S = 2, 3, 8
    buf = RolloutBuffer(B, eta=0)
    log: list[tuple[str, int]] = []
    log_lock = threading.Lock()
    todo = iter(range(S * B))
    todo_lock = threading.Lock()

    def producer() -> None:
        while True:
            with todo_lock:
                if next(todo, None) is None:
                    return
            t = buf.admit(timeout=LONG)
            assert t is not None
            with log_lock:
                log.append(("admit", t.version))
            buf.put(Grp([Ep([buf.version])], t.id), t)

    threads = [threading.Thread(target=producer) for _ in range(P)]
    for t in threads:
        t.start()
    for step in range(S):
        batch = buf.get_batch(B, timeout=LONG)
        assert batch is not None and len(batch) == B
        assert buf.num_in_flight == 0 and not buf.can_admit()   # nothing runs while training
        assert group_versions(batch[0]) + group_versions(batch[1]) == [step, step]
        with log_lock:   # held across publish, so an admit of v+1 is logged after it
            buf.publish_version()
            log.append(("publish", step + 1))
    join_all(threads)
    published = 0
    for kind, v in log:
        if kind == "publish":
            published = v
        else:
            assert v == published, "a rollout started before its version was published"
    m = buf.metrics()
    assert m["staleness_hist"] == {"0": S * B} and m["started_per_version"] == {
        str(k): B for k in range(S)}


@pytest.mark.parametrize("eta", [1, 2])
def test_a_late_group_is_waited_for_and_reaches_exactly_eta(eta: int) -> None:
    """B = 1. The first group of version 0 is held back while fresher ones finish; the
    trainer takes the fresher ones until step eta, where the held one is due: get_batch
    then waits for it (rather than take a fresher one), and it is consumed eta stale."""
    buf = RolloutBuffer(1, eta=eta)
    held = buf.admit(0)
    early = [buf.admit(0) for _ in range(eta)]
    assert buf.admit(timeout=SHORT) is None
    for i, t in enumerate(early):
        buf.put(grp(0, gid=i + 1), t)
    taken = []
    for step in range(eta):
        [g] = buf.get_batch(1, timeout=0)
        taken.append(g.gid)
        assert buf.publish_version() == step + 1
        t = buf.admit(0)
        assert t.version == step + 1
        buf.put(grp(t.version, gid=100 + step), t)
    assert buf.version == eta
    assert buf.get_batch(1, timeout=SHORT) is None   # finished groups ready, but g0 is due
    got: list = []
    waiting = threading.Thread(target=lambda: got.extend(buf.get_batch(1, timeout=LONG)))
    waiting.start()
    buf.put(grp(0, gid=0), held)
    join_all([waiting])
    assert [g.gid for g in got] == [0]
    m = buf.metrics()
    assert m["max_staleness"] == eta and m["group_staleness_hist"][str(eta)] == 1
    assert taken == list(range(1, eta + 1))


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_threaded_run_bounds_staleness_and_drops_nothing(eta: int) -> None:
    """Producer threads with heavy-tailed rollout durations whose tokens carry the version
    current when sampled (interruptible rollouts); a trainer publishing a version a step.
    Max staleness <= eta, every started group is consumed exactly once, and no admission
    ever ran more than (eta + 1) batches ahead."""
    B, P, S = 3, 4, 12
    buf = RolloutBuffer(B, eta=eta)
    todo = iter(range(S * B))
    lock = threading.Lock()
    put_ids: list[int] = []
    tickets: list[Ticket] = []
    errors: list[BaseException] = []

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while True:
                with lock:
                    if next(todo, None) is None:
                        return
                t = buf.admit(timeout=LONG)
                assert t is not None
                tokens = 20 if rng.random() < 0.15 else rng.randint(1, 4)  # a long tail
                versions = []
                for _ in range(tokens):
                    time.sleep(rng.random() * 0.0005)
                    versions.append(buf.version)
                buf.put(Grp([Ep(versions), Ep([t.version])], t.id), t)
                with lock:
                    put_ids.append(t.id)
                    tickets.append(t)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(P)]
    for t in threads:
        t.start()
    consumed: list[int] = []
    max_stale = 0
    for step in range(S):
        batch = buf.get_batch(B, timeout=LONG)
        assert batch is not None, f"step {step}: no batch ({errors})"
        for g in batch:
            consumed.append(g.gid)
            max_stale = max(max_stale, max(step - v for v in group_versions(g)))
        buf.publish_version()
    join_all(threads)
    assert not errors
    assert max_stale <= eta
    assert sorted(consumed) == sorted(put_ids) == list(range(S * B))   # none dropped
    for t in tickets:   # AReaL's rule: started <= (version + eta + 1) * B
        assert t.id + 1 <= (t.version + eta + 1) * B
    m = buf.metrics()
    assert m["consumed"] == m["started"] == m["finished"] == S * B
    assert max(int(k) for k in m["staleness_hist"]) == m["max_staleness"] <= eta
    assert m["groups_in_flight"] == m["groups_ready"] == 0


# -- the trainer's side -------------------------------------------------------------------------


def test_get_batch_is_oldest_first_all_or_nothing_and_bounded_per_version() -> None:
    buf = RolloutBuffer(3, eta=1)
    ts = [buf.admit(0) for _ in range(3)]
    buf.put(grp(0, gid=2), ts[2])
    buf.put(grp(0, gid=0), ts[0])
    assert buf.get_batch(3, timeout=SHORT) is None        # only two finished: take none
    assert buf.num_ready == 2
    assert [g.gid for g in buf.get_batch(2, timeout=0)] == [0, 2]
    with pytest.raises(ValueError, match="publish_version"):
        buf.get_batch(2)                                  # 1 of this version's 3 left
    buf.put(grp(0, gid=1), ts[1])
    assert [g.gid for g in buf.get_batch(1, timeout=0)] == [1]


def test_publish_refuses_to_strand_a_due_group() -> None:
    buf = RolloutBuffer(1, eta=0)
    t = buf.admit(0)
    buf.put(grp(0), t)
    with pytest.raises(StalenessError, match="get_batch"):
        buf.publish_version()
    assert buf.version == 0
    buf.get_batch(timeout=0)
    assert buf.publish_version() == 1


def test_put_validates_tickets_and_versions_and_matches_without_one() -> None:
    buf = RolloutBuffer(2, eta=1)
    with pytest.raises(RuntimeError, match="admit"):
        buf.put(grp(0))
    t0 = buf.admit(0)
    buf.put(grp(0), t0)
    with pytest.raises(RuntimeError, match="not in flight"):
        buf.put(grp(0), t0)
    buf.get_batch(2, timeout=SHORT)  # times out: one finished
    t1 = buf.admit(0)
    buf.put(grp(0))                  # no ticket: takes t1
    assert buf.num_in_flight == 0
    buf.get_batch(2, timeout=0)
    buf.publish_version()
    t2 = buf.admit(0)
    with pytest.raises(RuntimeError, match="sample only after admit"):
        buf.put(grp(0), t2)          # tokens older than the admission
    buf.abort(t2)
    assert buf.metrics()["aborted_per_version"] == {"1": 1}
    assert buf.can_admit()
    assert t1.version == 0


def test_abort_frees_a_due_slot() -> None:
    buf = RolloutBuffer(2, eta=0)
    a, b = buf.admit(0), buf.admit(0)
    buf.put(grp(0), a)
    assert buf.get_batch(2, timeout=SHORT) is None
    buf.abort(b)                       # the rollout crashed: a fresh one takes its place
    c = buf.admit(0)
    assert c.version == 0
    buf.put(grp(0), c)
    assert len(buf.get_batch(2, timeout=0)) == 2


def test_close_unblocks_every_waiter() -> None:
    buf = RolloutBuffer(1, eta=0)
    buf.admit(0)                                   # fills version 0; nothing finished
    outcomes: list[str] = []
    started = threading.Barrier(3)

    def call(fn) -> None:
        started.wait(LONG)
        try:
            fn()
            outcomes.append("returned")
        except BufferClosed as e:
            outcomes.append("closed" if "closed" in str(e) else repr(e))

    threads = [threading.Thread(target=call, args=(lambda: buf.admit(timeout=LONG),)),
               threading.Thread(target=call, args=(lambda: buf.get_batch(timeout=LONG),))]
    for t in threads:
        t.start()
    started.wait(LONG)
    deadline = time.monotonic() + LONG   # let both reach their wait (closing earlier must
    while time.monotonic() < deadline:   # end them the same way, so this is not ordering)
        m = buf.metrics()
        if m["waiting_admit"] == 1 and m["waiting_get"] == 1:
            break
        time.sleep(0.001)
    buf.close()
    join_all(threads)
    assert outcomes == ["closed", "closed"]
    for fn in (lambda: buf.admit(0), lambda: buf.get_batch(timeout=0), lambda: buf.put(grp(0))):
        with pytest.raises(BufferClosed):
            fn()
    assert buf.state_dict()["in_flight"]           # still readable for a last checkpoint


# -- checkpoints ---------------------------------------------------------------------------------


def _busy_buffer() -> RolloutBuffer:
    buf = RolloutBuffer(2, eta=1)
    ts = [buf.admit(0) for _ in range(4)]
    for i, t in enumerate(ts[:3]):
        buf.put({"samples": [{"versions": [-1, 0, 0], "reward": float(i)}], "gid": i}, t)
    buf.get_batch(2, timeout=0)
    buf.publish_version()
    t = buf.admit(0)
    buf.put({"samples": [{"version": 1}], "gid": 4}, t)
    return buf   # ready: gid 2 (v0) and 4 (v1); in flight: ts[3] (v0)


def test_state_dict_round_trip_through_json() -> None:
    buf = _busy_buffer()
    state = json.loads(json.dumps(buf.state_dict()))
    new = RolloutBuffer(2, eta=1)
    new.load_state_dict(state)
    before, after = buf.metrics(), new.metrics()
    assert after["aborted"] == before["aborted"] + 1   # the rollout in flight is gone
    for k in ("version", "started_per_version", "finished_per_version",
              "consumed_per_version", "staleness_hist", "groups_ready"):
        assert after[k] == before[k], k
    assert after["groups_in_flight"] == 0
    # it continues where it stopped: the v0 group is due now, so it comes first
    assert [g["gid"] for g in new.get_batch(2, timeout=0)] == [2, 4]
    t = new.admit(0)
    assert t.id == 5 and t.version == 1
    assert json.loads(json.dumps(new.state_dict()))["next_id"] == 6


def test_state_dict_pickles_dataclass_groups_and_refuses_other_configs() -> None:
    buf = RolloutBuffer(2, eta=2)
    t = buf.admit(0)
    buf.put(grp(0, gid=7), t)
    state = pickle.loads(pickle.dumps(buf.state_dict()))
    new = RolloutBuffer(2, eta=2)
    new.load_state_dict(state)
    assert new.state_dict()["ready"][0]["group"] == grp(0, gid=7)
    with pytest.raises(ConfigError, match="eta"):
        RolloutBuffer(2, eta=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="format"):
        RolloutBuffer(2, eta=2).load_state_dict({**state, "format": 99})
    with pytest.raises(RuntimeError, match="in use"):
        new.load_state_dict(state)
