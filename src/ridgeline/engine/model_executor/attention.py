"""The one attention path of every model: write this step's keys/values into the paged
cache, then attend each sequence's new queries to its whole context.

The tokens of a step are flat ([T, heads, head_dim]) and belong to three kinds of
sequences, each with the cheapest kernel we found on CPU:

- fresh: no KV before this step (a prompt, or its first chunk). With the C kernel
  (float32 or bfloat16 cache) causal attention over the cache, which already holds the
  new keys/values (`cpu_kernels.paged_prefill_attention`, one call for every fresh and
  long sequence of the step); otherwise PyTorch's fused causal attention over the fresh
  keys/values themselves.
- short queries over cached context (decode: 1 token; speculative verification: a few).
  With the C kernel (`cpu_kernels`, float32 or bfloat16 model on CPU, float32, bfloat16
  or int8 cache; 16-wide AVX-512 where the CPU has it) all of them in one call that reads
  the blocks in place. Otherwise batched in PyTorch:
  sequences of similar length are grouped, their blocks gathered into a padded [n, L]
  layout (padding reads the null block) and masked; grouped-query heads are folded into
  the query axis, so keys/values are never repeated per head.
- long queries over cached context (later prefill chunks, prefix-cache hits): with the C
  kernel, in the same prefill call as the fresh ones, reading the blocks in place;
  otherwise one masked attention per sequence over its gathered blocks.

Sliding-window layers (`AttentionMetadata.layer_windows`, transformers' convention: a query
at position p sees the keys at positions (p - window, p]) take the same paths: the C
kernels get the window and skip the blocks before it, the PyTorch paths a mask with the
window's lower bound too (built once per step and window, on first use). Blocks before
every sliding layer's window may have been released by the scheduler: their table
entries are then the null block, which neither path reads unmasked.

Attention sinks (gpt-oss: `paged_attention(..., sinks=)`, a learned logit per query head
that joins the softmax's denominator and is then dropped) work on every path: the C
kernels take them (the online softmax's final sum gains exp(sink - max)); the PyTorch
paths run the fused CPU attention op that also returns each row's logsumexp, and scale
its output by sum / (sum + exp(sink)) = sigmoid(lse - sink) (`_attend_with_sinks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.kv_cache import KVCache

#: Sequences with at most this many new tokens (and some cached context) are batched.
MAX_BATCHED_QUERY = 8


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [n * q] rows of the flat batch (padding repeats a row)
    block_ids: torch.Tensor  # [n * num_blocks] padded with the null block
    mask: torch.Tensor  # additive [n, 1, q_rows, L]
    num_seqs: int
    q_len: int  # padded query length of the group
    valid: torch.Tensor | None  # [n * q] which entries of token_index are real (q > 1)
    limit: torch.Tensor | None = None  # [n, q] each query sees positions < its limit
    group_size: int = 1  # query heads per KV head (rows of the mask per query)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` for a sliding-window layer: also -inf before limit - window."""
        if window <= 0:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            assert self.limit is not None
            mask = _additive(_window_allowed(self.limit, self.mask.shape[-1], window,
                                             self.group_size))
            self.window_masks[window] = mask[:, None].to(self.mask.device)
            mask = self.window_masks[window]
        return mask


@dataclass
class KernelBatch:
    """Short-query sequences for the C kernel: everything it needs, as int64 tensors."""

    block_table: torch.Tensor  # [n, max blocks], padded with the null block
    q_start: torch.Tensor  # [n] first row of each sequence in the flat batch
    q_len: torch.Tensor  # [n]
    ctx_len: torch.Tensor  # [n] context including the new tokens
    cuts: list[int]  # per-thread shares of the work items (split_work / prefill_work)


@dataclass
class PrefillBatch(KernelBatch):
    """Fresh and long sequences for the C prefill kernel: its work items are tiles."""

    work: torch.Tensor  # [items, 4] the kernel's tiles (cpu_kernels.prefill_work)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    fresh: list[tuple[int, int]] = field(default_factory=list)  # (start, length)
    # (start, length, context length, block ids covering the context, causal mask [n, ctx])
    chunks: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    groups: list[DecodeGroup] = field(default_factory=list)
    kernel: KernelBatch | None = None
    # fresh and long sequences for the C prefill kernel, instead of `fresh` and `chunks`
    prefill: PrefillBatch | None = None
    # each layer's sliding window (0: full attention); empty: every layer is full
    layer_windows: tuple[int, ...] = ()
    # the PyTorch paths' sliding-window masks, by (queries, cached tokens, window)
    window_masks: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def causal_window_mask(self, num_new: int, num_computed: int, window: int,
                           device: torch.device) -> torch.Tensor:
        """Boolean [1, 1, num_new, context]: query i (position num_computed + i) sees
        positions (its own - window, its own]."""
        key = (num_new, num_computed, window)
        mask = self.window_masks.get(key)
        if mask is None:
            pos = torch.arange(num_computed, num_computed + num_new)[:, None]
            keys = torch.arange(num_computed + num_new)[None, :]
            mask = ((keys <= pos) & (keys > pos - window))[None, None].to(device)
            self.window_masks[key] = mask
        return mask


def build_attention_metadata(batch: list[tuple[list[int], int, int]], block_size: int,
                             num_heads: int, num_kv_heads: int, device: torch.device,
                             use_kernel: bool = False, prefill_kernel: bool = False,
                             layer_windows: tuple[int, ...] = ()) -> AttentionMetadata:
    """`batch`: per sequence (block table, tokens already computed, new tokens), in the
    order their tokens appear in the flat batch. `use_kernel`: short queries go to the C
    decode kernel; `prefill_kernel`: fresh and long ones to the C prefill kernel (a float32
    or bfloat16 cache), so their PyTorch metadata (chunk masks) is not built.
    `layer_windows`: each layer's sliding window, 0 for full attention (empty: all full)."""
    bs = block_size
    slots: list[int] = []
    fresh: list[tuple[int, int]] = []
    chunks: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
    short: list[tuple[int, int, int, list[int]]] = []  # (start, q_len, ctx_len, table)
    long: list[tuple[int, int, int, list[int]]] = []  # the same, fresh and chunks
    start = 0
    for table, num_computed, num_new in batch:
        end = num_computed + num_new
        if num_new == 1:
            slots.append(table[num_computed // bs] * bs + num_computed % bs)
        else:
            slots.extend(table[p // bs] * bs + p % bs for p in range(num_computed, end))
        if 0 < num_computed and num_new <= MAX_BATCHED_QUERY:
            short.append((start, num_new, end, table))
        elif prefill_kernel:
            long.append((start, num_new, end, table))
        elif num_computed == 0:
            fresh.append((start, num_new))
        else:
            nb = -(-end // bs)
            rows = torch.arange(num_new)[:, None]
            mask = torch.arange(end)[None, :] <= rows + num_computed
            chunks.append((start, num_new, end,
                           torch.tensor(table[:nb], dtype=torch.long, device=device),
                           mask[None, None].to(device)))
        start += num_new
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        fresh=fresh, chunks=chunks,
        layer_windows=tuple(layer_windows) if any(layer_windows) else ())
    if long:
        meta.prefill = _prefill_batch(long, bs, num_heads, num_kv_heads)
    if short and use_kernel:
        meta.kernel = _kernel_batch(short, bs, num_kv_heads)
        return meta
    group_size = num_heads // num_kv_heads
    for members in _bucket_by_length(short, bs):
        meta.groups.append(_decode_group(members, bs, group_size, device))
    return meta


def _padded_table(seqs: list[tuple[int, int, int, list[int]]], bs: int) -> torch.Tensor:
    """[n, blocks of the longest context] int64, padded with the null block."""
    nb = max(-(-ctx // bs) for _, _, ctx, _ in seqs)
    flat: list[int] = []
    for _, _, ctx, table in seqs:
        used = -(-ctx // bs)
        flat += table[:used]
        flat += [0] * (nb - used)
    return torch.tensor(flat, dtype=torch.long).view(len(seqs), nb)


def _prefill_batch(long: list[tuple[int, int, int, list[int]]], bs: int, num_heads: int,
                   num_kv_heads: int) -> PrefillBatch:
    q_len = [s[1] for s in long]
    ctx_len = [s[2] for s in long]
    work, cuts = cpu_kernels.prefill_work(q_len, ctx_len, num_kv_heads,
                                          num_heads // num_kv_heads, torch.get_num_threads())
    return PrefillBatch(
        block_table=_padded_table(long, bs),
        q_start=torch.tensor([s[0] for s in long], dtype=torch.long),
        q_len=torch.tensor(q_len, dtype=torch.long),
        ctx_len=torch.tensor(ctx_len, dtype=torch.long), work=work, cuts=cuts)


def _kernel_batch(short: list[tuple[int, int, int, list[int]]], bs: int,
                  num_kv_heads: int) -> KernelBatch:
    return KernelBatch(
        block_table=_padded_table(short, bs),
        q_start=torch.tensor([s[0] for s in short], dtype=torch.long),
        q_len=torch.tensor([s[1] for s in short], dtype=torch.long),
        ctx_len=torch.tensor([s[2] for s in short], dtype=torch.long),
        cuts=cpu_kernels.split_work([s[2] for s in short], num_kv_heads,
                                    torch.get_num_threads()))


def _bucket_by_length(short: list[tuple[int, int, int, list[int]]],
                      bs: int) -> list[list[tuple[int, int, int, list[int]]]]:
    """Group sequences of similar context length so padding to the longest wastes little;
    a few groups are cheaper than one padded to the longest or one call per sequence."""
    order = sorted(short, key=lambda s: -s[2])
    groups: list[list[tuple[int, int, int, list[int]]]] = []
    cur: list[tuple[int, int, int, list[int]]] = []
    cur_blocks = 0
    for s in order:
        nb = -(-s[2] // bs)
        if cur:
            longest = -(-cur[0][2] // bs)
            if len(cur) >= 8 and longest * (len(cur) + 1) > 1.3 * (cur_blocks + nb):
                groups.append(cur)
                cur, cur_blocks = [], 0
        cur.append(s)
        cur_blocks += nb
    if cur:
        groups.append(cur)
    return groups


def _decode_group(members: list[tuple[int, int, int, list[int]]], bs: int, group_size: int,
                  device: torch.device) -> DecodeGroup:
    n = len(members)
    q = max(m[1] for m in members)
    nb = max(-(-m[2] // bs) for m in members)
    length = nb * bs
    flat_blocks: list[int] = []
    for _, _, ctx_len, table in members:
        used = -(-ctx_len // bs)
        flat_blocks += table[:used]
        flat_blocks += [0] * (nb - used)  # the null block
    starts = torch.tensor([m[0] for m in members])
    qlens = torch.tensor([m[1] for m in members])
    ctx = torch.tensor([m[2] for m in members])
    qi = torch.arange(q)
    # padding rows (beyond a sequence's own queries) repeat its last real query
    token_index = torch.minimum(starts[:, None] + qi[None, :], (starts + qlens - 1)[:, None])
    # query i of a sequence sees positions < ctx - (q_len - 1 - i)
    limit = (ctx[:, None] - (qlens[:, None] - 1 - qi[None, :])).clamp(min=1)  # [n, q]
    mask = _additive(_window_allowed(limit, length, 0, group_size))
    valid = (qi[None, :] < qlens[:, None]).reshape(-1) if q > 1 else None
    return DecodeGroup(
        token_index=token_index.reshape(-1).to(device),
        block_ids=torch.tensor(flat_blocks, dtype=torch.long, device=device),
        mask=mask[:, None].to(device), num_seqs=n, q_len=q,
        valid=None if valid is None else valid.to(device), limit=limit,
        group_size=group_size)


def _window_allowed(limit: torch.Tensor, length: int, window: int,
                    group_size: int) -> torch.Tensor:
    """Boolean [n, rows, length]: query (i, j) sees positions < limit[i, j] (and, with a
    sliding window, >= limit - window); with several queries per sequence the rows are
    ordered (head in group, query) to match the folded query layout."""
    n, q = limit.shape
    positions = torch.arange(length)[None, None, :]
    allowed = positions < limit[:, :, None]  # [n, q, L]
    if window > 0:
        allowed &= positions >= (limit - window)[:, :, None]
    if q > 1:
        allowed = allowed[:, None].expand(n, group_size, q, length).reshape(n, group_size * q,
                                                                            length)
    return allowed


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed,
                                                                        float("-inf"))


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sinks: torch.Tensor, *, mask: torch.Tensor | None = None,
                       is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """sdpa(q [b, h, n, d], k/v [b, kvh, L, d]) with attention sinks (float32, broadcast
    to [b, h, n]): softmax over the scores and the sink, the sink's share dropped. `mask`:
    boolean (True: seen) or additive."""
    if mask is not None:
        mask = (torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
                .masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool
                else mask.to(q.dtype))  # the fused op takes an additive mask of q's dtype
    if q.is_cpu and _FLASH_CPU is not None:
        out, lse = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        return out * torch.sigmoid(lse - sinks).unsqueeze(-1).to(out.dtype)
    # elsewhere transformers' eager formula (the score matrix materialised)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None
                                                   else scale)
    if is_causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask.float())
    both = torch.cat([scores, sinks.float().expand(*scores.shape[:-1]).unsqueeze(-1)], -1)
    return both.softmax(-1)[..., :-1].to(v.dtype) @ v


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    layer: int, meta: AttentionMetadata, *,
                    scale: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, heads, d], k/v [T, kv_heads, d] (after RoPE) -> output [T, heads * d].
    Scores are scaled by `scale` (default head_dim ** -0.5); the layer's sliding window
    comes from `meta.layer_windows`; `sinks`: float32 [heads], each query head's attention
    sink (None: no sinks)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    g = num_heads // num_kv_heads
    window = meta.window(layer)
    cache.write(layer, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    if meta.kernel is not None:
        kb = meta.kernel
        raw = cache.raw_blocks(layer)
        if raw is not None:
            cpu_kernels.paged_decode_attention(q, raw[0], raw[1], kb.block_table,
                                               kb.q_start, kb.q_len, kb.ctx_len, out,
                                               cuts=kb.cuts, window=window, scale=scale,
                                               sinks=sinks)
        else:
            codes = cache.int8_blocks(layer)
            assert codes is not None, "the C kernel needs a float32, bfloat16 or int8 CPU cache"
            cpu_kernels.paged_decode_attention(q, codes[0], codes[1], kb.block_table,
                                               kb.q_start, kb.q_len, kb.ctx_len, out,
                                               k_scale=codes[2], v_scale=codes[3],
                                               cuts=kb.cuts, window=window, scale=scale,
                                               sinks=sinks)

    if meta.prefill is not None:
        pb = meta.prefill
        raw = cache.raw_blocks(layer)
        assert raw is not None, "the prefill kernel needs a float32 or bfloat16 CPU cache"
        cpu_kernels.paged_prefill_attention(q, raw[0], raw[1], pb.block_table, pb.q_start,
                                            pb.q_len, pb.ctx_len, out, pb.work, pb.cuts,
                                            window=window, scale=scale, sinks=sinks)

    # 4-D inputs: only those take the fused CPU kernel (3-D ones fall back to the slow
    # reference path that materialises the whole score matrix).
    for start, n in meta.fresh:
        qs = q[start:start + n].transpose(0, 1)[None]
        ks = k[start:start + n].transpose(0, 1)[None]
        vs = v[start:start + n].transpose(0, 1)[None]
        if sinks is not None:
            o = _attend_with_sinks(
                qs, ks, vs, sinks.view(1, num_heads, 1), scale=scale,
                mask=meta.causal_window_mask(n, 0, window, q.device) if 0 < window < n
                else None, is_causal=not 0 < window < n)
        elif window > 0 and n > window:
            o = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=meta.causal_window_mask(n, 0, window, q.device),
                enable_gqa=g > 1, scale=scale)
        else:  # a window at least as long as the prompt cuts nothing
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=g > 1,
                                               scale=scale)
        out[start:start + n] = o[0].transpose(0, 1)

    for start, n, ctx, block_ids, mask in meta.chunks:
        kc, vc = cache.gather(layer, block_ids)
        kc = kc[:ctx].transpose(0, 1)[None]
        vc = vc[:ctx].transpose(0, 1)[None]
        if window > 0:
            mask = meta.causal_window_mask(n, ctx - n, window, q.device)
        qs = q[start:start + n].transpose(0, 1)[None]
        if sinks is not None:
            o = _attend_with_sinks(qs, kc, vc, sinks.view(1, num_heads, 1), mask=mask,
                                   scale=scale)
        else:
            o = F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, enable_gqa=g > 1,
                                               scale=scale)
        out[start:start + n] = o[0].transpose(0, 1)

    for grp in meta.groups:
        n, ql = grp.num_seqs, grp.q_len
        kc, vc = cache.gather(layer, grp.block_ids)
        kc = kc.view(n, -1, num_kv_heads, head_dim).transpose(1, 2)  # [n, kvh, L, d]
        vc = vc.view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
        qg = q.index_select(0, grp.token_index)  # [n * ql, h, d]
        if ql == 1:
            qg = qg.view(n, num_kv_heads, g, head_dim)
        else:
            qg = (qg.view(n, ql, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4)
                  .reshape(n, num_kv_heads, g * ql, head_dim))
        if sinks is not None:  # rows of a KV head: (query head in group, query)
            rows = sinks.view(1, num_kv_heads, g, 1).expand(1, num_kv_heads, g, ql)
            o = _attend_with_sinks(qg, kc, vc, rows.reshape(1, num_kv_heads, g * ql),
                                   mask=grp.window_mask(window), scale=scale)
        else:
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=grp.window_mask(window),
                                               scale=scale)
        if ql == 1:
            out.index_copy_(0, grp.token_index, o.reshape(n, num_heads, head_dim))
        else:
            o = (o.view(n, num_kv_heads, g, ql, head_dim).permute(0, 3, 1, 2, 4)
                 .reshape(n * ql, num_heads, head_dim))
            assert grp.valid is not None
            out.index_copy_(0, grp.token_index[grp.valid], o[grp.valid])
    return out.view(num_tokens, num_heads * head_dim)
