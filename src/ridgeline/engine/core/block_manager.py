"""The KV block pool: reference-counted fixed-size blocks, a prefix cache keyed by a hash
chain over full blocks, and LRU eviction of cached blocks nobody uses.

Block 0 is the null block: never handed out, it pads block tables in batched attention.
Free blocks wait in an ordered queue; allocation takes from the front, a finished
sequence's blocks go to the back tail-first, so the least recently used prefix (and of one
sequence, its tail) is evicted first. A free block keeps its hash until it is reused, so a
later request with the same prefix can take it back (a prefix-cache hit).

With `sliding_window` (a model whose every attention layer sees only the last `window`
positions, and no other model reading the same blocks), a sequence's blocks wholly before
the window of the next token it computes are released as it advances: its table keeps
their places (so position p still lives in table[p // bs]) as the null block, and its KV
stays bounded by the window however long it grows. A released block is only
dereferenced: a block another sequence shares stays theirs, and a cached one keeps its
prefix-cache key until it is reused, like any free block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

from ridgeline.engine.sequence import Sequence

NULL_BLOCK = 0

BlockKey = tuple  # (parent block hash | None, salt, token ids of the block)


class Block:
    __slots__ = ("block_id", "ref_count", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: BlockKey | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.key is not None})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int,
                 sliding_window: int | None = None) -> None:
        assert num_blocks >= 2, "need the null block and at least one usable block"
        assert sliding_window is None or sliding_window >= 1
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_count = 1  # pinned forever
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cache: dict[BlockKey, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        self.num_evictions = 0

    # ---- the questions the scheduler asks ---------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds now (its table less the released ones)."""
        return len(seq.block_table) - seq.num_released_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by live sequences."""
        return 1.0 - len(self.free) / (len(self.blocks) - 1)

    def block_key(self, block_id: int) -> BlockKey | None:
        """The prefix-cache key of a block's contents (None: not in the cache)."""
        return self.blocks[block_id].key

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """The longest run of cached full blocks that prefixes `seq`. The last token is
        never served from the cache: its logits must be computed."""
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.cache.get(self._key(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: Seq[int] = ()) -> bool:
        """Give `seq` room for `num_new_tokens` more tokens of KV (after taking the cached
        `computed_blocks`, only when it starts from nothing). False when the pool is
        short; nothing changes then."""
        assert not computed_blocks or not seq.block_table
        bs = self.block_size
        num_computed = seq.num_computed_tokens + len(computed_blocks) * bs
        total = num_computed + num_new_tokens
        num_needed = -(-total // bs) - len(seq.block_table) - len(computed_blocks)
        # Cached hits that sit in the free queue stop being free once taken.
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_needed > len(self.free) - num_revived:
            return False
        for b in computed_blocks:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self.free[b]
            block.ref_count += 1
            seq.block_table.append(b)
        for _ in range(max(num_needed, 0)):
            seq.block_table.append(self._take_free_block())
        self._cache_full_blocks(seq, total)
        self._release_out_of_window(seq, num_computed)
        return True

    def _release_out_of_window(self, seq: Sequence, num_computed: int) -> None:
        """Release the blocks of `seq` that no query from position `num_computed` on can
        see: those wholly before (num_computed - window, ...]. Speculative tokens and
        later chunks only come after num_computed, so nothing released is read again
        (preemption recomputes from scratch and a draft model keeps every block: no
        window then)."""
        if self.sliding_window is None:
            return
        first_needed = num_computed - self.sliding_window + 1
        end = min(max(first_needed, 0) // self.block_size, seq.num_registered_blocks)
        for i in range(seq.num_released_blocks, end):
            block = self.blocks[seq.block_table[i]]
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None
            seq.block_table[i] = NULL_BLOCK
        seq.num_released_blocks = max(seq.num_released_blocks, end)

    def free_seq(self, seq: Sequence) -> None:
        """Release the sequence's blocks; tail first, so its tail is evicted first."""
        for b in reversed(seq.block_table[seq.num_released_blocks:]):
            block = self.blocks[b]
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[b] = None
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        seq.num_released_blocks = 0

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks beyond the first `num_tokens` tokens of `seq` (slots reserved
        for speculative tokens that were rejected). They were never cached, so they go to
        the front of the free queue: reused before any cached block is evicted."""
        keep = -(-num_tokens // self.block_size)
        assert keep >= seq.num_registered_blocks, "cannot free a cached block of a live seq"
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.key is None, block
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after the weights changed)."""
        for block_id in self.cache.values():
            self.blocks[block_id].key = None
        self.cache.clear()

    # ---- internals --------------------------------------------------------------------

    def _key(self, seq: Sequence, i: int) -> BlockKey:
        """Key of the i-th full block of `seq`: parent hash, salt and the block's tokens."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) <= i:
            j = len(hashes)
            key = (hashes[j - 1] if j else None, seq.cache_salt,
                   tuple(seq.token_ids[j * bs:(j + 1) * bs]))
            hashes.append(hash(key))
        return (hashes[i - 1] if i else None, seq.cache_salt,
                tuple(seq.token_ids[i * bs:(i + 1) * bs]))

    def _take_free_block(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.key is not None:  # evict from the prefix cache
            if self.cache.get(block.key) == block_id:
                del self.cache[block.key]
            block.key = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that `num_tokens` fill completely (their KV is written in the
        step being scheduled, before any attention reads it)."""
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.key is None:
                key = self._key(seq, i)
                # A twin computed concurrently by another sequence stays uncached.
                if key not in self.cache:
                    block.key = key
                    self.cache[key] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    # ---- for tests and metrics --------------------------------------------------------

    def check_invariants(self, live: Seq[Sequence]) -> None:
        """Every block is either free (ref 0, in the queue once) or held by exactly
        ref_count live sequences; the prefix cache only points at blocks with that key."""
        holders = [0] * len(self.blocks)
        for seq in live:
            released = seq.block_table[:seq.num_released_blocks]
            assert all(b == NULL_BLOCK for b in released), f"{seq} kept a released block"
            for b in seq.block_table[seq.num_released_blocks:]:
                assert b != NULL_BLOCK, f"{seq} holds the null block"
                holders[b] += 1
        for block in self.blocks[1:]:
            assert block.ref_count == holders[block.block_id], (
                f"{block} held by {holders[block.block_id]} sequences")
            assert (block.ref_count == 0) == (block.block_id in self.free), block
        for key, block_id in self.cache.items():
            assert self.blocks[block_id].key == key
        assert self.blocks[NULL_BLOCK].ref_count == 1 and NULL_BLOCK not in self.free
