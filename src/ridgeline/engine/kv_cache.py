"""Paged K/V storage. Every read and write of the cache goes through `KVCache`, so its
storage format (today the model dtype; later int8/fp8 with per-block scales) can change in
this one class without touching the models or the attention path."""

from __future__ import annotations

import mmap

import torch


class KVCache:
    """For each layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim]. A token
    at position p of a sequence lives in slot `block_table[p // bs] * bs + p % bs`."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        if self.k:
            return
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        per_tensor = self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
        # zeros, not garbage: padding reads the null block and unwritten slots of partial
        # blocks, which are masked, but 0 * NaN would still poison the output
        flat = _zeros(2 * self.num_layers * per_tensor, self.dtype, self.device)
        for i in range(2 * self.num_layers):
            t = flat[i * per_tensor:(i + 1) * per_tensor].view(shape)
            (self.k if i % 2 == 0 else self.v).append(t)

    def release(self) -> None:
        self.k.clear()
        self.v.clear()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store new keys/values [T, num_kv_heads, head_dim] at their slots."""
        kvh, d = self.num_kv_heads, self.head_dim
        self.k[layer].view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(self.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks, as [len(block_ids) * block_size,
        num_kv_heads, head_dim] tensors in the model dtype."""
        k = self.k[layer].index_select(0, block_ids)
        v = self.v[layer].index_select(0, block_ids)
        return k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads,
                                                                    self.head_dim)

    def raw_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V block tensors themselves, for kernels that read blocks where they
        lie; None when the storage is not plain values of a supported dtype (a
        quantized cache must be read through gather())."""
        if self.dtype not in (torch.float32, torch.bfloat16) or self.device.type != "cpu":
            return None
        return self.k[layer], self.v[layer]

    def int8_blocks(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """(K codes, V codes, K scales, V scales) of an int8 cache, for kernels that
        dequantize as they read; None for every other storage."""
        return None


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer. On CPU an anonymous mapping: the kernel hands out zero pages that
    become resident only when written, so an idle or lightly used pool costs no RAM, and
    releasing it returns the memory to the OS (sleep/wake)."""
    if device.type != "cpu" or numel == 0:
        return torch.zeros(numel, dtype=dtype, device=device)
    buf = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=numel)
