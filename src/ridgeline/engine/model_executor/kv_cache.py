"""Paged K/V storage. Every read and write of the cache goes through `KVCache`, so its
storage format (today the model dtype; later int8/fp8 with per-block scales) can change in
this one class without touching the models or the attention path."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import threading
import time

import torch

from ridgeline.engine.kernels import decode_ops

log = logging.getLogger(__name__)


class KVCache:
    """For each layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim]. A token
    at position p of a sequence lives in slot `block_table[p // bs] * bs + p % bs`."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", prefault: bool = False) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.prefault = prefault
        self._prefaulter: Prefaulter | None = None
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
        buffers = self._allocate_storage()
        if self.prefault and self.device.type == "cpu":
            self._prefaulter = Prefaulter(buffers)

    def _allocate_storage(self) -> list[torch.Tensor]:
        """Fill self.k / self.v; returns the flat buffers they view."""
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        per_tensor = self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
        # zeros, not garbage: padding reads the null block and unwritten slots of partial
        # blocks, which are masked, but 0 * NaN would still poison the output
        flat = _zeros(2 * self.num_layers * per_tensor, self.dtype, self.device)
        for i in range(2 * self.num_layers):
            t = flat[i * per_tensor:(i + 1) * per_tensor].view(shape)
            (self.k if i % 2 == 0 else self.v).append(t)
        return [flat]

    def release(self) -> None:
        if self._prefaulter is not None:
            self._prefaulter.stop()  # it holds the buffers: they go once it has stopped
            self._prefaulter = None
        self.k.clear()
        self.v.clear()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store new keys/values [T, num_kv_heads, head_dim] at their slots."""
        kvh, d = self.num_kv_heads, self.head_dim
        many = slot_mapping.shape[0] >= decode_ops.SCATTER_MIN_ROWS
        for cache, x in ((self.k[layer], k), (self.v[layer], v)):
            slots = cache.view(-1, kvh, d)
            if not (many and decode_ops.scatter_rows(slots, slot_mapping, x)):
                slots.index_copy_(0, slot_mapping, x.to(self.dtype))

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


class LatentKVCache(KVCache):
    """Multi-head latent attention's cache (deepseek_v3): per layer one
    [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] tensor holding each
    token's compressed KV and its rope key, stored once. The attention path reads it as
    both keys and values (`v[layer] is k[layer]`): in the absorbed form the scores are
    taken against the whole latent and the output is a mix of it (the model drops the
    rope columns of the output), so nothing is expanded per head or stored twice. Same
    block and slot arithmetic as `KVCache`. A storage dtype other than the model's
    (`model_dtype`) is cast on write and back on gather."""

    def __init__(self, *, model_dtype: torch.dtype | None = None, **shape: object) -> None:
        super().__init__(**shape)  # type: ignore[arg-type]
        self.model_dtype = model_dtype or self.dtype
        assert self.num_kv_heads == 1, "the latent is one head"

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k)

    def _allocate_storage(self) -> list[torch.Tensor]:
        shape = (self.num_blocks, self.block_size, 1, self.head_dim)
        per_layer = self.num_blocks * self.block_size * self.head_dim
        flat = _zeros(self.num_layers * per_layer, self.dtype, self.device)
        for i in range(self.num_layers):
            t = flat[i * per_layer:(i + 1) * per_layer].view(shape)
            self.k.append(t)
            self.v.append(t)  # the same tensor: values are read from the latent
        return [flat]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' latents [T, 1, latent_dim] (`v` is the same latent)."""
        slots = self.k[layer].view(-1, 1, self.head_dim)
        if not (slot_mapping.shape[0] >= decode_ops.SCATTER_MIN_ROWS
                and decode_ops.scatter_rows(slots, slot_mapping, k)):
            slots.index_copy_(0, slot_mapping, k.to(self.dtype))

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent = (self.k[layer].index_select(0, block_ids).view(-1, 1, self.head_dim)
                  .to(self.model_dtype))
        return latent, latent


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer. On CPU an anonymous mapping: the kernel hands out zero pages that
    become resident only when written, so an idle or lightly used pool costs no RAM, and
    releasing it returns the memory to the OS (sleep/wake)."""
    if device.type != "cpu" or numel == 0:
        return torch.zeros(numel, dtype=dtype, device=device)
    buf = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=numel)


#: madvise(2) advice that makes pages resident as if written, without writing them
#: (Linux 5.14+); elsewhere prefaulting is skipped.
_MADV_POPULATE_WRITE = 23
_PREFAULT_CHUNK = 32 << 20


class Prefaulter:
    """Makes a lazily resident CPU pool resident in a background thread, chunk by chunk:
    the first write to each 4 KB page of an anonymous mapping is a page fault (~5 us a
    page in a VM whose host also maps the page on first touch), which otherwise lands on
    the forward passes of the engine's first requests: 1.3 GB of KV written in
    engine_bench, 2-4 s of a 50 s run on a 2-core VM. The advice only maps pages: data
    already written is untouched, so the engine runs meanwhile. `stop()` ends it between
    chunks (sleep() frees the pool)."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._buffers = buffers
        self._stop = threading.Event()
        self.seconds: float | None = None  # how long it took, once done
        self._thread = threading.Thread(target=self._run, name="ridgeline-kv-prefault",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if not sys.platform.startswith("linux"):
            return
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        t0 = time.perf_counter()
        for buf in self._buffers:
            start, size = buf.data_ptr(), buf.numel() * buf.element_size()
            for off in range(0, size, _PREFAULT_CHUNK):
                if self._stop.is_set():
                    return
                # ctypes drops the GIL for the call: the engine's threads run meanwhile
                if madvise(start + off, min(_PREFAULT_CHUNK, size - off),
                           _MADV_POPULATE_WRITE) != 0:
                    log.debug("KV pool prefault skipped (madvise errno %d)", ctypes.get_errno())
                    return
        self.seconds = time.perf_counter() - t0
        log.debug("KV pool resident in %.2f s", self.seconds)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the thread has finished (within `timeout`)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._buffers = []
