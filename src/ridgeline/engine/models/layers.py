"""Building blocks shared by every model: linear layers with uninitialised (to be loaded)
weights, RMSNorm and rotary embeddings. Numerics follow transformers' float32 formulas so
that greedy outputs match it token for token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b, with W allocated but not initialised: weights are always loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # same order of operations as transformers' LlamaRMSNorm (compute in float32)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, looked up by position."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * attention_scaling).to(dtype).to(device),
                             persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_scaling).to(dtype).to(device),
                             persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [T, 1, head_dim] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]: the rotate-half form, x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
