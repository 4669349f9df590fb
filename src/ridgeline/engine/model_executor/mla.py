"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the paged cache, in the
absorbed form, for prefill and decode alike.

Per token the cache holds the latent: the normalised compressed KV `c` (kv_lora_rank
values) and the rotated rope key `k_rope` (qk_rope_head_dim values), shared by all heads
(`kv_cache.LatentKVCache`). With kv_b_proj's weight split per head into W_uk
[nope, rank] and W_uv [v, rank], head h's key is [W_uk c, k_rope] and its value W_uv c,
so

    score = q_nope . W_uk c + q_rope . k_rope = [W_uk^T q_nope, q_rope] . [c, k_rope]
    out   = W_uv (sum_j p_j c_j)

The query is absorbed through W_uk once per token and head, the scores are taken against
the latent itself, and the attention output is a mix of latents, projected through W_uv
after. That is multi-query attention with one KV "head" of width rank + rope whose
values are the keys themselves (the rope columns of the output are dropped): the shared
`attention.paged_attention` runs it unchanged, K and V being the same tensor, so every
path of the engine (fresh prompts, later chunks, prefix hits, batched decode, the C
kernels where the latent width fits them, at most 256: not DeepSeek-V3's 576, whose
attention takes the PyTorch paths) reads the latent in place and nothing is expanded per
head or cached twice. Exact in real arithmetic; in floating point the products are
associated differently from transformers' expanded K/V (float32: ~1e-6 apart).

Prefill uses the absorbed form too: expanding K/V for the new tokens would need the
cached context expanded as well on every later chunk and prefix hit; the absorbed scores
cost rank + rope multiply-adds a key instead of nope + rope, which a CPU prefill of this
engine's sizes affords.
"""

from __future__ import annotations

import torch

from ridgeline.engine.model_executor.attention import AttentionMetadata, paged_attention
from ridgeline.engine.model_executor.kv_cache import KVCache


def latent_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_latent: torch.Tensor,
                     k_rope: torch.Tensor, kv_b_weight: torch.Tensor, cache: KVCache,
                     layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q_nope [T, h, nope] and q_rope [T, h, rope] (rotated), this step's kv_latent
    [T, rank] (normalised) and k_rope [T, rope] (rotated), kv_b_proj's weight
    [h * (nope + v), rank] -> the heads' outputs [T, h * v], ready for o_proj. The step's
    latents are written to the cache at `meta.slot_mapping`."""
    t, h, nope = q_nope.shape
    rank = kv_latent.shape[1]
    kv_b = kv_b_weight.view(h, -1, rank)  # per head: W_uk rows, then W_uv rows
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    q_absorbed = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [h, T, rank]
    query = torch.cat((q_absorbed.transpose(0, 1), q_rope), dim=-1)  # [T, h, rank + rope]
    latent = torch.cat((kv_latent, k_rope), dim=-1)[:, None]  # [T, 1, rank + rope]
    out = paged_attention(query, latent, latent, cache, layer, meta, scale=scale)
    mixed = out.view(t, h, -1)[..., :rank]  # the rope columns' mix is no value
    values = torch.bmm(mixed.transpose(0, 1), w_uv.transpose(1, 2))  # [h, T, v]
    return values.transpose(0, 1).reshape(t, -1)
