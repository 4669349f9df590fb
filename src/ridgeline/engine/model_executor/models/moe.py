"""The sparse mixture-of-experts MLP (Qwen3-MoE; DeepSeek-V3's routing and shared experts
in `GroupedSigmoidMoeBlock`; gpt-oss's in `GptOssMoeBlock`) for a flat batch of tokens.

A router (`gate`, a plain linear layer) scores every expert for every token; each token
goes to its top-k experts, weighted by their softmax probabilities (renormalised to sum
to one with `norm_topk_prob`). The experts are SwiGLU MLPs whose weights sit in two
fused tensors, transformers 5's layout: `gate_up_proj` [E, 2I, H] (the gate rows, then
the up rows) and `down_proj` [E, H, I].

Execution has no per-token Python: the (token, expert) pairs are sorted by expert, so
each expert's rows are one contiguous slice of a gathered copy of the hidden states; each
expert that received rows runs as one product per projection through `layers.linear` (the
C kernel for a few rows, oneDNN with its packed weight for many), and the weighted rows
are summed back into their tokens with one `index_add_`, in the order transformers sums
them (ascending expert id). Why a Python loop over the experts that got rows rather than
`torch._grouped_mm` (2 cores, AVX-512 BF16, 128 experts of 1024 x 256, top-8, ms for the
experts' products, loop / grouped_mm): float32 1 token 0.73 / 1.99, 16 tokens 12.9 /
26.4, 64 tokens 22.3 / 49.0, 512 tokens 50.6 / 75.1, 2048 tokens 166 / 227; bfloat16 1
token 0.23 / 0.86, 64 tokens 14.5 / 22.7, 256 tokens 25.2 / 31.0, 1024 tokens 80.8 /
57.8 (grouped_mm ahead only for large bf16 prefills; a shared, noisy machine). Gathering
all rows at once and concatenating the experts' outputs measured faster than a gather and
an `index_add_` per expert at every size (the per-call costs of the latter at decode).

gpt-oss's experts run through the same execution with two options of `FusedExperts`:
biases on both projections, and another activation (`clamped_swiglu`, on gate and up rows
interleaved, the order of gpt-oss's checkpoints, so its fused tensor loads as a plain
transposed view).

Routing is a separate step (`SparseMoeBlock.route`) so that other schemes (DeepSeek-V3's
sigmoid scores with a correction bias and group-limited top-k; shared experts, a
`layers.DenseMLP` added to the routed ones) can subclass the block without touching the
expert execution.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ridgeline.engine.model_executor.models.config import ModelConfig
from ridgeline.engine.model_executor.models.layers import (
    DenseMLP,
    Linear,
    int8_linear,
    linear,
    quantize_int8,
    swiglu,
)


def softmax_top_k(router_logits: torch.Tensor, top_k: int, normalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's routing: (expert ids [T, k] int64, weights [T, k] in the logits'
    dtype), the softmax computed in float32 as transformers does."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return expert_ids, weights.to(router_logits.dtype)


def grouped_sigmoid_top_k(router_logits: torch.Tensor, correction_bias: torch.Tensor,
                          top_k: int, num_groups: int, topk_groups: int, normalize: bool,
                          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter, step for step, float32
    logits): sigmoid scores; the correction bias shifts them for choosing only; experts
    come from the `topk_groups` groups whose two best (biased) scores sum highest; the
    chosen experts' unbiased scores, renormalised with `normalize`, times `scaling`.
    Returns (expert ids [T, k], float32 weights [T, k])."""
    num_experts = router_logits.shape[-1]
    scores = router_logits.sigmoid()
    for_choice = scores + correction_bias
    per_group = for_choice.view(-1, num_groups, num_experts // num_groups)
    group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
    best_groups = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1)
    expert_mask = (group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups)
                   .reshape(-1, num_experts))
    for_choice = for_choice.masked_fill(~expert_mask.bool(), float("-inf"))
    expert_ids = torch.topk(for_choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, expert_ids)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return expert_ids, weights * scaling


def clamped_swiglu(gate_up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of a fused [rows, 2n] gate/up projection whose columns
    alternate gate, up (its checkpoints' order) -> [rows, n]: the gate clamped above at
    `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), in
    transformers' order of operations."""
    gate = gate_up[:, ::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class FusedExperts(nn.Module):
    """`num_experts` experts in two fused tensors; after `quantize_int8()` int8 weights
    with a scale per output channel of each expert (the float tensors freed). By default
    SwiGLU without biases; `bias`: a bias per output of both projections (`gate_up_bias`
    [E, 2I], `down_bias` [E, H], kept in the model dtype under int8); `activation`: the
    function from the gate/up product [rows, 2I] to [rows, I] (default `swiglu`, gate rows
    first)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device | str, *, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.activation = activation or swiglu
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden,
                                                     dtype=dtype, device=device),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype,
                                                  device=device), requires_grad=False)
        self.register_parameter("gate_up_bias", None)
        self.register_parameter("down_bias", None)
        if bias:
            self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype,
                                                         device=device), requires_grad=False)
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype,
                                                      device=device), requires_grad=False)
        self.register_buffer("gate_up_q", None, persistent=False)
        self.register_buffer("gate_up_scales", None, persistent=False)
        self.register_buffer("down_q", None, persistent=False)
        self.register_buffer("down_scales", None, persistent=False)
        self._bind_experts()

    def _bind_experts(self) -> None:
        """Each expert's (gate_up, down) weights, and int8 scales, as views made once:
        `linear` caches oneDNN's packed copy of a weight by tensor identity (and version,
        which views share with the fused tensor, so in-place updates repack)."""
        biases = [(None, None) if self.gate_up_bias is None
                  else (self.gate_up_bias[e], self.down_bias[e]) for e in range(self.num_experts)]
        if self.gate_up_q is not None:
            self._experts = [(self.gate_up_q[e], self.gate_up_scales[e], self.down_q[e],
                              self.down_scales[e], *biases[e]) for e in range(self.num_experts)]
        else:
            self._experts = [(self.gate_up_proj[e], None, self.down_proj[e], None, *biases[e])
                             for e in range(self.num_experts)]

    @property
    def quantized(self) -> bool:
        return self.gate_up_q is not None

    def quantize_int8(self) -> None:
        e, i, h = self.num_experts, self.inter, self.hidden
        dtype = self.gate_up_proj.dtype
        q, scale = quantize_int8(self.gate_up_proj.reshape(e * 2 * i, h))
        self.gate_up_q, self.gate_up_scales = q.view(e, 2 * i, h), scale.view(e, 2 * i).to(dtype)
        q, scale = quantize_int8(self.down_proj.reshape(e * h, i))
        self.down_q, self.down_scales = q.view(e, h, i), scale.view(e, h).to(dtype)
        self.gate_up_proj = nn.Parameter(self.gate_up_proj.new_empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(self.down_proj.new_empty(0), requires_grad=False)
        self._bind_experts()

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, gate_up_scales, down, down_scales, gate_up_bias, down_bias = self._experts[e]
        act = self.activation
        if gate_up_scales is not None:
            return int8_linear(act(int8_linear(rows, gate_up, gate_up_scales, gate_up_bias)),
                               down, down_scales, down_bias)
        return linear(act(linear(rows, gate_up, gate_up_bias)), down, down_bias)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], each token's experts and weights [T, k] -> sum over its k experts of
        weight * expert(x), [T, H] in x's dtype."""
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        order = flat.argsort(stable=True)  # rows grouped by expert, tokens in order within
        token_of_row = order.div(top_k, rounding_mode="floor")
        rows = x.index_select(0, token_of_row)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self._expert(e, rows[start:start + n]))
                start += n
        if not outs:  # no tokens
            return torch.zeros_like(x)
        out_rows = torch.cat(outs) if len(outs) > 1 else outs[0]
        out_rows.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, token_of_row, out_rows)


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP: softmax top-k routing over fused experts. Parameter names
    follow transformers' (`gate.weight`, `experts.gate_up_proj`, `experts.down_proj`)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # the router stays in the model dtype under weight_quant=int8: it is small, and
        # an int8 rounding of its logits could change which experts a token picks
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, dtype, device)
        self.experts = FusedExperts(cfg.num_experts, cfg.hidden_size,
                                    cfg.moe_intermediate_size, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k]."""
        return softmax_top_k(self.gate(x), self.top_k, self.normalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_ids, weights = self.route(x)
        return self.experts(x, expert_ids, weights)

    def quantize_int8(self) -> None:
        self.experts.quantize_int8()


class GroupedSigmoidMoeBlock(SparseMoeBlock):
    """DeepSeek-V3's sparse MLP (DeepseekV3MoE): `grouped_sigmoid_top_k` routing over the
    fused experts, plus the shared experts (one dense SwiGLU MLP every token goes
    through). The router, its weight and its correction bias are float32 whatever the
    model dtype, as transformers keeps them (`_keep_in_fp32_modules_strict`): a rounded
    score could change which experts a token picks. Parameter names follow transformers'
    (`gate.weight`, `gate.e_score_correction_bias`, `shared_experts.*`), the bias here as
    `e_score_correction_bias`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        super().__init__(cfg, dtype, device)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, torch.float32, device)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.num_experts, dtype=torch.float32, device=device),
            requires_grad=False)
        self.num_groups, self.topk_groups = cfg.num_expert_groups, cfg.topk_groups
        self.scaling = cfg.routed_scaling_factor
        inter = cfg.shared_expert_intermediate_size
        self.shared_experts = (DenseMLP(cfg.hidden_size, inter, False, dtype, device)
                               if inter else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_sigmoid_top_k(self.gate(x.float()), self.e_score_correction_bias,
                                     self.top_k, self.num_groups, self.topk_groups,
                                     self.normalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # the float32 weights multiply rows of x's dtype in place
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def quantize_int8(self) -> None:
        super().quantize_int8()
        if self.shared_experts is not None:
            self.shared_experts.quantize_int8()


class GptOssMoeBlock(SparseMoeBlock):
    """gpt-oss's sparse MLP (GptOssMLP): the router a linear layer with a bias; each token
    takes the experts of its top-k logits, weighted by a softmax over those k logits (in
    the logits' dtype, as transformers); the experts have biases and `clamped_swiglu`
    (gate and up interleaved: `gate_up_proj` [E, 2I, H] is the transpose of the
    checkpoint's [E, H, 2I]). Parameter names: `gate.*` is the checkpoint's `router.*`,
    `experts.gate_up_bias` / `down_bias` its `gate_up_proj_bias` / `down_proj_bias`."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
                 ) -> None:
        nn.Module.__init__(self)  # not SparseMoeBlock's: other router and experts
        assert cfg.swiglu_limit is not None, "gpt_oss configs set swiglu_limit"
        self.top_k = cfg.num_experts_per_tok
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, True, dtype, device)
        self.experts = FusedExperts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
            bias=True, activation=partial(clamped_swiglu, alpha=cfg.swiglu_alpha,
                                          limit=cfg.swiglu_limit))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, expert_ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        return expert_ids, torch.softmax(top, dim=-1, dtype=top.dtype)
