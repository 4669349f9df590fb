"""Turns a scheduled batch into tensors (flat token ids, positions, cache slots, attention
metadata), runs the model and returns logits for the sequences that sample."""

from __future__ import annotations

import torch

from ridgeline.engine.attention import build_attention_metadata
from ridgeline.engine.kv_cache import KVCache
from ridgeline.engine.models import DecoderForCausalLM
from ridgeline.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, device: torch.device,
                 use_kernel: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.use_kernel = use_kernel  # decode attention through cpu_kernels

    def execute(self, scheduled: list[tuple[Sequence, int]]
                ) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute the scheduled tokens; return the sequences whose last token was computed
        (they sample next) and their logits [n, vocab]."""
        input_ids: list[int] = []
        positions: list[int] = []
        batch: list[tuple[list[int], int, int]] = []
        logit_rows: list[int] = []
        samplers: list[Sequence] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            batch.append((seq.block_table, start, n))
            if start + n == seq.num_tokens:
                logit_rows.append(len(input_ids) - 1)
                samplers.append(seq)
        cfg = self.model.cfg
        meta = build_attention_metadata(batch, self.kv_cache.block_size, cfg.num_heads,
                                        cfg.num_kv_heads, self.device, self.use_kernel)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids_t, pos_t, self.kv_cache, meta)
        if not samplers:
            return samplers, None
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return samplers, self.model.compute_logits(hidden.index_select(0, rows))
