"""Every decoder layer of a decode pass in one C call (csrc/decode_stack.c).

In a decode step each layer makes about a dozen calls from Python into the C kernels
(norms, projections, rotary, the KV write, attention, SwiGLU, the residual add), each a
few microseconds of argument checks, a fresh output tensor and ctypes conversions, which
add up to a sizeable share of a single-request step. `run_layers` hands the whole stack to
`decoder_stack`, which calls the very same kernels, in the same order, with the same
arguments (function pointers taken from their libraries), on buffers allocated once per
pass: its output is bit for bit the layer loop's.

It applies where every piece of a pass is one of those kernels (`applies`): a float32 or
bfloat16 model (int8 weights too) without q/k norms, rows few enough for the linear kernel
(`max_rows`), attention through the decode kernel, a KV cache of the model's dtype or of
int8 codes (written as `kv_quant` quantizes). Attention's per-thread shares and a pass's
row-wise steps run on the linear kernel's thread pool (`linear_parallel`), whose helpers
are awake from the matmul before. Anything else (prompts, large bf16 batches, fp8 caches)
runs the layer loop. Measurements: docs/benchmarks.md, "Engine C kernels".
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import torch

from ridgeline.engine.kernels import cpu_kernels, decode_ops, kernel_build, linear_kernel

_FLAGS = [["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC"],
          ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]]
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _ptr) for n in ("linear", "norm", "rotary", "scatter", "attention",
                                    "silu", "parallel", "attention_i8", "scatter_i8")]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("layers", _i64), ("dt", _int), ("block_size", _int),
                ("eps", _f32), ("scale", _f32)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm_in", _ptr), ("norm_post", _ptr), ("w", _ptr * 4), ("s", _ptr * 4),
                ("b", _ptr * 4), ("wt", _int * 4), ("st", _int * 4), ("bt", _int * 4),
                ("k_cache", _ptr), ("v_cache", _ptr), ("k_scale", _ptr), ("v_scale", _ptr)]


class _Pass(ctypes.Structure):
    _fields_ = [("t", _i64), ("num_slots", _i64), ("table_stride", _i64),
                ("x", _ptr), ("cos_", _ptr), ("sin_", _ptr), ("slots", _ptr),
                ("block_table", _ptr), ("q_start", _ptr), ("q_len", _ptr), ("ctx_len", _ptr),
                ("xn", _ptr), ("qkv", _ptr), ("attn", _ptr), ("o", _ptr), ("gu", _ptr),
                ("act", _ptr), ("down", _ptr), ("cuts", _ptr), ("shares", _i64),
                ("threads", _int)]


def _build() -> ctypes.CDLL | None:
    lib = kernel_build.open_library("decode_stack", kernel_build.read_source("decode_stack"),
                                    _FLAGS)
    if lib is None:
        return None
    lib.decoder_stack.argtypes = [_ptr, _ptr, _ptr, _ptr]
    lib.decoder_stack.restype = _int
    return lib


load = kernel_build.LazyLibrary(_build)


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _kernels(dtype: torch.dtype) -> _Kernels | None:
    """The kernels of a `dtype` pass, or None where one of their libraries is missing."""
    ops, lin, att = decode_ops.load(), linear_kernel.load(), cpu_kernels.load()
    if ops is None or lin is None or att is None:
        return None
    f32 = dtype == torch.float32
    return _Kernels(
        _address(lin.linear_run), _address(ops.rms_norm_f32 if f32 else ops.rms_norm_bf16),
        _address(ops.rotary_f32 if f32 else ops.rotary_bf16), _address(ops.scatter_rows),
        _address(att.paged_attention_f32 if f32 else att.paged_attention_bf16),
        _address(ops.silu_mul_f32 if f32 else ops.silu_mul_bf16),
        _address(lin.linear_parallel), _address(att.paged_attention_i8),
        _address(ops.scatter_int8_rows))


_kernel_table: dict[torch.dtype, _Kernels | None] = {}

#: float32 passes of up to this many rows run as one stack call where the linear kernel
#: is 16 lanes wide (AVX-512), although `linear` gives products of more than 16 rows to
#: oneDNN (faster there alone): the stack saves the layer loop's dozen Python calls a
#: layer and splits the row-wise steps. Measurements: docs/benchmarks.md, "Engine
#: constants".
FLOAT32_MAX_ROWS = 64


def max_rows(dtype: torch.dtype, quantized: bool, linear_rows: int) -> int:
    """The most rows of a pass the stack takes for a model of `dtype` (int8 weights:
    `quantized`): as many as the model's linear layers give the kernel (`linear_rows`),
    and float32 up to FLOAT32_MAX_ROWS on the 16-lane kernel."""
    rows = linear_rows
    if dtype == torch.float32 and not quantized and _sixteen_lanes():
        return max(rows, FLOAT32_MAX_ROWS)
    return rows


@functools.cache
def _sixteen_lanes() -> bool:
    return linear_kernel.vector_width() == 16


def applies(model: Any, rows: int, cache: Any, meta: Any, linear_rows: int) -> bool:
    """Whether a pass of `rows` tokens with this attention metadata can run as one
    `decoder_stack` call (see the module doc); `linear_rows`: the most rows the model's
    linear layers give the linear kernel (`layers.kernel_max_rows`)."""
    dtype = model.dtype
    kb = meta.kernel
    if (dtype not in (torch.float32, torch.bfloat16) or kb is None or meta.prefill is not None
            or meta.fresh or meta.chunks or meta.groups
            or torch.is_grad_enabled() or model.cfg.qk_norm
            or model.cfg.moe_layers  # the C stack runs dense SwiGLU MLPs only
            or any(model.cfg.layer_windows)  # and attends to the whole context
            or model.cfg.attention_sinks  # without sinks
            or model.cfg.head_dim > decode_ops.MAX_HEAD_DIM or model.embed.device.type != "cpu"
            or rows > max_rows(dtype, model.quantized, linear_rows)
            or load() is None):
        return False
    raw = cache.raw_blocks(0)
    if not ((raw is not None and raw[0].dtype == dtype)
            or (cache.int8_blocks(0) is not None and cache.dtype == dtype)):
        return False  # fp8 codes, or a cache stored in another dtype than the model's
    if dtype not in _kernel_table:
        _kernel_table[dtype] = _kernels(dtype)
    return _kernel_table[dtype] is not None


def _weights(proj: Any) -> tuple[int, int, int, int, int, int]:
    """(weight, scale, bias) pointers and dtype codes of a Linear (float or int8)."""
    if proj.qweight is not None:
        w, s = proj.qweight, proj.scales
    else:
        w, s = proj.weight, None
    b = proj.bias
    assert w.is_contiguous() and (b is None or b.is_contiguous())
    return (w.data_ptr(), 0 if s is None else s.data_ptr(),
            0 if b is None else b.data_ptr(), _CODES[w.dtype],
            0 if s is None else _CODES[s.dtype], 0 if b is None else _CODES[b.dtype])


def _layer_table(model: Any, cache: Any) -> tuple[Any, _Shape, int]:
    """The C view of the model's layers and KV blocks (pointers, dtype codes), its shape
    and the cache's number of slots, built once per model and cache storage: rebuilding it
    took ~0.4 ms a pass (5% of a single-request step). Weights change in place
    (`load_weights` copies into them), so their pointers hold; the cache's storage is new
    after sleep/wake, and int8 quantization replaces the weights, so both are in the key."""
    blocks0 = cache.raw_blocks(0) or cache.int8_blocks(0)
    key = (id(cache), blocks0[0].data_ptr(), model.quantized)
    hit = _tables.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    cfg = model.cfg
    layers = (_Layer * len(model.layers))()
    for i, layer in enumerate(model.layers):
        entry = layers[i]
        entry.norm_in = layer.input_norm.weight.data_ptr()
        entry.norm_post = layer.post_norm.weight.data_ptr()
        for j, proj in enumerate((layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                  layer.down_proj)):
            (entry.w[j], entry.s[j], entry.b[j], entry.wt[j], entry.st[j],
             entry.bt[j]) = _weights(proj)
        blocks = cache.raw_blocks(layer.index) or cache.int8_blocks(layer.index)
        entry.k_cache, entry.v_cache = blocks[0].data_ptr(), blocks[1].data_ptr()
        if len(blocks) == 4:  # int8 codes and their scales
            entry.k_scale, entry.v_scale = blocks[2].data_ptr(), blocks[3].data_ptr()
    shape = _Shape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                   cfg.intermediate_size, len(model.layers), _CODES[model.dtype],
                   blocks0[0].shape[1], model.layers[0].input_norm.eps, cfg.head_dim ** -0.5)
    table = (layers, shape, blocks0[0].shape[0] * blocks0[0].shape[1])
    _tables[model] = (key, table)
    return table


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_layers(model: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: Any, meta: Any) -> torch.Tensor:
    """x [t, hidden] through every decoder layer of `model` (in place; returned), as the
    layer loop computes it. Callers check `applies` first."""
    cfg, dtype = model.cfg, model.dtype
    t, hidden = x.shape
    h, kvh, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    layers, shape, num_slots = _layer_table(model, cache)
    x = x.contiguous()
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    slots = meta.slot_mapping.contiguous()
    kb = meta.kernel

    def buf(width: int) -> torch.Tensor:
        return torch.empty(t, width, dtype=dtype)

    bufs = [buf(hidden), buf((h + 2 * kvh) * d), buf(h * d), buf(hidden), buf(2 * inter),
            buf(inter), buf(hidden)]
    cuts = (ctypes.c_int64 * len(kb.cuts))(*kb.cuts)
    one_pass = _Pass(t, num_slots, kb.block_table.stride(0),
                     x.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                     kb.block_table.data_ptr(), kb.q_start.data_ptr(), kb.q_len.data_ptr(),
                     kb.ctx_len.data_ptr(), *[b.data_ptr() for b in bufs],
                     ctypes.cast(cuts, ctypes.c_void_p), len(kb.cuts) - 1,
                     torch.get_num_threads())
    rc = load().decoder_stack(ctypes.byref(_kernel_table[dtype]), ctypes.byref(shape),
                              layers, ctypes.byref(one_pass))
    if rc:
        layer, step = divmod(-rc - 1, 8)
        if step == 1:
            raise IndexError(f"a KV slot of this pass is outside the cache of "
                             f"{one_pass.num_slots} slots (layer {layer})")
        raise RuntimeError(f"the decode stack failed in layer {layer}, step {step}")
    return x
