"""The block pool: exact block ids, reference counts, prefix-cache hits and LRU eviction
order on a tiny pool; and invariants under random add / step / abort sequences."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ridgeline.engine.core.block_manager import BlockManager
from ridgeline.engine.core.scheduler import Scheduler
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.engine.sequence import Sequence, SequenceStatus


def make_seq(tokens: list[int], salt: object = None, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(tokens), len(tokens), SamplingParams(), cache_salt=salt)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """What the scheduler does for a new sequence; returns the cached tokens."""
    hits = bm.get_computed_blocks(seq)
    num_hit = len(hits) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - num_hit, hits)
    seq.num_computed_tokens = seq.num_tokens
    return num_hit


def refs(bm: BlockManager) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in bm.blocks[1:] if b.ref_count}


def test_exact_block_ids_sharing_and_eviction_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)  # block 0 is the null block
    a = make_seq(list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(bm, a) == 0
    assert a.block_table == [1, 2, 3]
    assert list(bm.free) == [4, 5, 6, 7]

    b = make_seq(list(range(8)) + [99])  # shares A's two full blocks
    assert admit(bm, b) == 8
    assert b.block_table == [1, 2, 4]
    assert refs(bm) == {1: 2, 2: 2, 3: 1, 4: 1}

    bm.free_seq(a)  # only A's private tail returns to the pool
    assert list(bm.free) == [5, 6, 7, 3]
    bm.free_seq(b)  # tail first: 4, then the shared blocks 2 and 1
    assert list(bm.free) == [5, 6, 7, 3, 4, 2, 1]
    assert refs(bm) == {}
    bm.check_invariants([])

    # fresh blocks come from the front of the queue; the cached prefix survives
    c = make_seq([50 + i for i in range(16)])
    assert admit(bm, c) == 0
    assert c.block_table == [5, 6, 7, 3]
    assert bm.num_evictions == 0
    # a new request with A's prefix still hits blocks 1 and 2 (revived from the queue)
    d = make_seq(list(range(8)) + [7, 7])
    assert admit(bm, d) == 8
    assert d.block_table == [1, 2, 4] and list(bm.free) == []
    bm.check_invariants([c, d])
    bm.free_seq(d)
    bm.free_seq(c)
    assert list(bm.free) == [4, 2, 1, 3, 7, 6, 5]
    # new demand evicts from the front: d's uncached tail 4, then cached block 2 (the
    # tail of the prefix goes before its head)
    e = make_seq([200 + i for i in range(8)])
    assert admit(bm, e) == 0
    assert e.block_table == [4, 2]
    assert bm.num_evictions == 1
    assert bm.get_computed_blocks(make_seq(list(range(9)))) == [1]


def test_lru_eviction_prefers_least_recently_used_prefix() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks
    p = make_seq([1, 2, 3, 4, 9])  # blocks [1, 2, 3]; [1, 2] cached
    admit(bm, p)
    bm.free_seq(p)  # queue: 4, 3, 2, 1
    q = make_seq([5, 6, 0])  # takes blocks 4 (cached: [5, 6]) and 3
    admit(bm, q)
    assert q.block_table == [4, 3]
    bm.free_seq(q)
    assert list(bm.free) == [2, 1, 3, 4]
    # reuse p's prefix: its blocks move out of the queue and come back at the end
    p2 = make_seq([1, 2, 3, 4, 8])
    assert admit(bm, p2) == 4
    assert p2.block_table == [1, 2, 3]  # block 3 was uncached (partial), reused first
    bm.free_seq(p2)
    assert list(bm.free) == [4, 3, 2, 1]
    # two new blocks: q's cached block 4 is now the least recently used -> evicted first
    r = make_seq([7, 7, 7, 7])
    admit(bm, r)
    assert r.block_table == [4, 3]
    assert bm.num_evictions == 1
    assert bm.get_computed_blocks(make_seq([5, 6, 0])) == []  # q's prefix is gone
    assert bm.get_computed_blocks(make_seq([1, 2, 3, 4, 0])) == [1, 2]  # p's survives


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(list(range(8)))
    admit(bm, a)
    assert len(bm.cache) == 2
    # the same 8 tokens again: only the first block is a hit, the last token is recomputed
    assert bm.get_computed_blocks(make_seq(list(range(8)))) == [a.block_table[0]]


def test_salt_isolates_requests() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, make_seq(list(range(9)), salt=1))
    assert bm.get_computed_blocks(make_seq(list(range(9)), salt=2)) == []
    assert len(bm.get_computed_blocks(make_seq(list(range(9)), salt=1))) == 2


def test_allocation_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(12)))
    admit(bm, a)
    b = make_seq(list(range(100, 105)))
    assert not bm.allocate_slots(b, 5)
    assert b.block_table == [] and bm.num_free_blocks == 0
    bm.check_invariants([a])


# ---- random add / step / abort ------------------------------------------------------

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
), min_size=1, max_size=40)


@settings(max_examples=120, deadline=None)
@given(ops=ops, num_blocks=st.integers(12, 40), block_size=st.sampled_from([1, 2, 4]),
       budget=st.sampled_from([4, 16, 64]), prefix_caching=st.booleans())
def test_random_traffic_keeps_invariants(ops, num_blocks, block_size, budget,
                                         prefix_caching) -> None:
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget)
    capacity = (num_blocks - 1) * block_size
    rng = random.Random(0)
    live: list[Sequence] = []
    done: list[Sequence] = []
    target: dict[int, int] = {}

    def check() -> None:
        bm.check_invariants(sched.running)
        for seq in sched.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in sched.running:
            assert seq.num_computed_tokens <= len(seq.block_table) * block_size

    def step() -> None:
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        for seq, n in out.scheduled:
            assert seq.status is SequenceStatus.RUNNING
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(4))
                if seq.num_output_tokens >= target[seq.seq_id] or seq.num_tokens >= capacity:
                    sched.finish(seq)
                    live.remove(seq)
                    done.append(seq)
        check()

    for n_req, op in enumerate(ops):
        if op[0] == "add":
            _, prompt_len, max_new, alphabet = op
            prompt_len = min(prompt_len, capacity - 1)
            # a small alphabet makes prompts share prefixes
            tokens = [rng.randrange(alphabet + 1) for _ in range(prompt_len)]
            seq = make_seq(tokens, salt=None if prefix_caching else n_req)
            target[seq.seq_id] = max_new
            sched.add(seq)
            live.append(seq)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif live:
            seq = live.pop(op[1] % len(live))
            sched.finish(seq)
            done.append(seq)
        check()

    for _ in range(20000):  # everything left finishes: no deadlock, no leak
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished() and not live
    assert all(s.is_finished for s in done)
    assert bm.num_free_blocks == num_blocks - 1
    bm.check_invariants([])
