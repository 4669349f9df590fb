"""Quantized paged KV storage (`EngineConfig.kv_cache_dtype`): keys and values are stored
in 8 bits with one float32 scale per token and KV head, and dequantized to the model dtype
when attention gathers a sequence's blocks. Same layout and slot arithmetic as `KVCache`,
so the block manager, scheduler and attention path do not know the difference.

- ``int8``: symmetric, ``q = round(x / s)`` in [-127, 127] with ``s = max|x| / 127`` over
  the head's channels. Symmetric (no zero point) because post-RoPE keys and values are
  centred per head; one scale per token and head keeps an outlier token or head from
  flattening the others. 1 byte per channel + 4 per (token, head).
- ``fp8`` / ``fp8_e4m3``: ``q = e4m3(x / s)`` with ``s = max|x| / 448`` (e4m3's largest
  finite value), stored as raw bytes because CPU kernels cannot index-copy float8 tensors.
  Relative error is constant across magnitudes (3 mantissa bits) instead of int8's
  uniform steps.

Scales are computed from each token as it is written, so no calibration is needed (a
fixed scale of 1.0 is what degrades uncalibrated fp8 caches in other engines).
"""

from __future__ import annotations

import torch

from ridgeline.engine.config import KV_CACHE_DTYPES, normalize_kv_cache_dtype
from ridgeline.engine.kernels import decode_ops
from ridgeline.engine.model_executor.kv_cache import KVCache, LatentKVCache, _zeros
from ridgeline.errors import ConfigError

__all__ = ["KV_CACHE_DTYPES", "QuantizedKVCache", "kv_bytes_per_token", "make_kv_cache",
           "normalize_kv_cache_dtype"]

_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZED = ("int8", "fp8_e4m3")

_INT8_MAX = 127.0
_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_SCALE_BYTES = 4  # float32 scale per (token, head)


def kv_bytes_per_token(kind: str, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       model_dtype: torch.dtype, latent: bool = False) -> int:
    """Bytes of K and V (with scales) one token takes across all layers; `latent`: MLA's
    cache (`LatentKVCache`), one latent of `head_dim` values a layer, no separate V."""
    kind = normalize_kv_cache_dtype(kind)
    if latent:
        _refuse_quantized_latent(kind)
        dtype = model_dtype if kind == "auto" else _FLOATS[kind]
        return LatentKVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)
    if kind in QUANTIZED:
        return 2 * num_layers * num_kv_heads * (head_dim + _SCALE_BYTES)
    dtype = model_dtype if kind == "auto" else _FLOATS[kind]
    return KVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def make_kv_cache(kind: str, *, num_layers: int, num_blocks: int, block_size: int,
                  num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                  device: torch.device | str = "cpu", prefault: bool = False,
                  latent: bool = False) -> KVCache:
    """The paged cache for `kind`; every variant returns keys/values in `model_dtype`.
    `prefault`: make the pool resident in the background (`kv_cache.Prefaulter`);
    `latent`: MLA's latent cache (`LatentKVCache`)."""
    kind = normalize_kv_cache_dtype(kind)
    shape = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, device=device,
                 prefault=prefault)
    if latent:
        _refuse_quantized_latent(kind)
        storage = model_dtype if kind == "auto" else _FLOATS[kind]
        return LatentKVCache(dtype=storage, model_dtype=model_dtype,
                             **shape)  # type: ignore[arg-type]
    if kind in QUANTIZED:
        return QuantizedKVCache(kind, model_dtype=model_dtype, **shape)  # type: ignore[arg-type]
    storage = model_dtype if kind == "auto" else _FLOATS[kind]
    if storage == model_dtype:
        return KVCache(dtype=storage, **shape)  # type: ignore[arg-type]
    return CastKVCache(storage, model_dtype=model_dtype, **shape)  # type: ignore[arg-type]


def _refuse_quantized_latent(kind: str) -> None:
    if kind in QUANTIZED:
        raise ConfigError(f"kv_cache_dtype={kind!r} is not supported for a latent-attention "
                          "(MLA) cache", hint="use auto, float32 or bfloat16")


# ---- codecs -------------------------------------------------------------------------------


def quantize(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (8-bit codes [..., head_dim] as int8/uint8, scale [...])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    if kind == "int8":
        scale = (amax / _INT8_MAX).clamp_(min=1e-12)
        codes = (xf / scale[..., None]).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    else:
        scale = (amax / _FP8_MAX).clamp_(min=1e-12)
        codes = (xf / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, kind: str,
               dtype: torch.dtype) -> torch.Tensor:
    if kind == "int8":
        x = codes.to(torch.float32)
    else:
        x = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return x.mul_(scale[..., None]).to(dtype)


class QuantizedKVCache(KVCache):
    """`KVCache` with 8-bit K/V codes and a float32 scale per (slot, head)."""

    def __init__(self, kind: str, *, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                 device: torch.device | str = "cpu", prefault: bool = False) -> None:
        assert kind in QUANTIZED, kind
        self.kind = kind
        self.code_dtype = torch.int8 if kind == "int8" else torch.uint8
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        # `dtype` stays the model dtype: what gather() returns
        super().__init__(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=model_dtype,
                         device=device, prefault=prefault)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in self.k + self.v + self.k_scale + self.v_scale)

    def _allocate_storage(self) -> list[torch.Tensor]:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        n_codes = shape[0] * shape[1] * shape[2] * shape[3]
        n_scales = shape[0] * shape[1] * shape[2]
        # zero codes and scales (lazily resident, like the float pool): padding reads of
        # the null block and unwritten slots dequantize to 0, never to NaN
        codes = _zeros(2 * self.num_layers * n_codes, self.code_dtype, self.device)
        scales = _zeros(2 * self.num_layers * n_scales, torch.float32, self.device)
        for i in range(2 * self.num_layers):
            c = codes[i * n_codes:(i + 1) * n_codes].view(shape)
            s = scales[i * n_scales:(i + 1) * n_scales].view(shape[:3])
            (self.k if i % 2 == 0 else self.v).append(c)
            (self.k_scale if i % 2 == 0 else self.v_scale).append(s)
        return [codes, scales]

    def release(self) -> None:
        super().release()
        self.k_scale.clear()
        self.v_scale.clear()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        kvh, d = self.num_kv_heads, self.head_dim
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.kind == "int8" and decode_ops.scatter_int8_rows(
                    codes[layer].view(-1, kvh, d), scales[layer].view(-1, kvh), slot_mapping, x):
                continue  # the same codes and scales, one C call
            q, s = quantize(x, self.kind)
            codes[layer].view(-1, kvh, d).index_copy_(0, slot_mapping, q)
            scales[layer].view(-1, kvh).index_copy_(0, slot_mapping, s)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kvh, d = self.num_kv_heads, self.head_dim
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            q = codes[layer].index_select(0, block_ids).view(-1, kvh, d)
            s = scales[layer].index_select(0, block_ids).view(-1, kvh)
            out.append(dequantize(q, s, self.kind, self.dtype))
        return out[0], out[1]

    def raw_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # codes are not values: kernels must read through gather()

    def int8_blocks(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        if (self.kind != "int8" or self.dtype not in (torch.float32, torch.bfloat16)
                or self.device.type != "cpu"):
            return None
        return self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]


class CastKVCache(KVCache):
    """A float cache whose storage dtype differs from the model's (e.g. bfloat16 KV for a
    float32 model): values are cast on write and back on gather."""

    def __init__(self, storage_dtype: torch.dtype, *, model_dtype: torch.dtype,
                 **shape: object) -> None:
        self.model_dtype = model_dtype
        super().__init__(dtype=storage_dtype, **shape)  # type: ignore[arg-type]

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().gather(layer, block_ids)
        return k.to(self.model_dtype), v.to(self.model_dtype)
