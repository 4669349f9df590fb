"""The small per-layer operations of a decode step (RMSNorm, residual add + RMSNorm,
SwiGLU's silu(gate) * up, rotary embedding, the KV writes) as one C call each, for up to a
few hundred rows (csrc/decode_ops.c).

At 1..16 tokens a decoder layer's matmuls are fast (`linear_kernel`) and what is left is
PyTorch's per-op cost: F.rms_norm is five ops, rotary four, SwiGLU three, each a dispatch
and a fresh tensor, and on larger inputs an OpenMP hand-off to a sleeping thread; over a
model's layers that is a large share of a step once the matmuls stream at memory speed.

The numerics are PyTorch's (and so transformers'): the same formulas, the same order and
rounding of every multiply and add (compiled with -ffp-contract=off), bfloat16 rounded
where PyTorch rounds it. Two places can differ in the last bit: the sum of squares of
RMSNorm (summed in 16 lanes, then folded) and the exp of SiLU (a polynomial of our own,
so that its loop vectorises). Single-threaded below `SPLIT_ROWS` rows (a second thread's
wake-up costs more than the work), split by rows over torch's intra-op threads from
there. Callers fall back to PyTorch where `usable(x)` is False: no compiler, other dtypes
or devices, autograd.
Measurements: docs/benchmarks.md, "Engine C kernels".
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ridgeline.engine.kernels import cpu_kernels, kernel_build

#: From this many rows (prefill chunks) each op is split by rows over torch's intra-op
#: threads: a C call a share, the calling thread taking the last one (below it, waking a
#: thread costs more than the op). 2 cores, OMP_WAIT_POLICY=PASSIVE as the engine runs,
#: PyTorch -> C split, us: 1024 rows, SwiGLU (x 1536) float32 945 -> 547, bfloat16 750 ->
#: 623; rotary (x 12 x 64) 570 -> 147 / 824 -> 330; RMSNorm of 2048 x 576, F.rms_norm
#: float32 466, the bfloat16 formula 772 -> C on one thread 500 / 425. At 64 rows
#: (float32, one thread): RMSNorm 88 -> 13, rotary 88 -> 21, SwiGLU 156 -> 98.
SPLIT_ROWS = 512


#: no FMA contraction: every product and sum rounds as in PyTorch's separate ops
_FLAGS = [["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC",
           "-lm"],
          ["-O3", "-ffp-contract=off", "-shared", "-fPIC", "-lm"]]
MAX_HEAD_DIM = 512

def _build() -> ctypes.CDLL | None:
    lib = kernel_build.open_library("decode_ops", kernel_build.read_source("decode_ops"),
                                    _FLAGS)
    if lib is None:
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm_f32.argtypes = [ptr, i64, ptr, i64, ptr, f32, ptr, i64, i64, i64]
    lib.rms_norm_bf16.argtypes = [ptr, i64, ptr, i64, ptr, f32, ptr, i64, i64, i64]
    for fn in (lib.silu_mul_f32, lib.silu_mul_bf16):
        fn.argtypes = [ptr, i64, ptr, i64, i64, i64]
    for fn in (lib.rotary_f32, lib.rotary_bf16):
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64]
    lib.argmax_logsumexp_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr]
    lib.scatter_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64]
    lib.scatter_rows.restype = ctypes.c_int
    lib.scatter_int8_rows.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, i64, i64, ptr, i64, i64]
    lib.scatter_int8_rows.restype = ctypes.c_int
    for fn in (lib.rms_norm_f32, lib.rms_norm_bf16, lib.silu_mul_f32, lib.silu_mul_bf16,
               lib.rotary_f32, lib.rotary_bf16, lib.argmax_logsumexp_f32):
        fn.restype = None
    return lib


#: The compiled library, or None where it cannot be built (not Linux, no compiler).
load = kernel_build.LazyLibrary(_build)


def usable(x: torch.Tensor) -> bool:
    """Whether `x` ([rows, ...] on CPU, float32 or bfloat16, no autograd) goes through
    these kernels."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.shape[0] > 0 and not torch.is_grad_enabled() and load() is not None)


def _by_rows(rows: int, part: Callable[[int, int], int], what: str) -> None:
    """part(lo, hi) over [0, rows): at once below SPLIT_ROWS, else in a share a thread."""
    if rows < SPLIT_ROWS:  # a decode step's case, ~120 calls a step: no share bookkeeping
        part(0, rows)
        return
    shares = max(1, min(torch.get_num_threads(), rows // (SPLIT_ROWS // 2)))
    cpu_kernels.run_shares(part, (), (), [rows * i // shares for i in range(shares + 1)], what)


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [rows, d] times weight; with `delta`, first x += delta in place (the
    residual add before a norm). Callers check `usable(x)`; x must be rows of unit stride
    and writable, weight contiguous in x's dtype."""
    lib = load()
    assert lib is not None and _rows_ok(x) and weight.dtype == x.dtype
    rows, d = x.shape
    out = torch.empty(rows, d, dtype=x.dtype)
    if delta is not None and (not _rows_ok(delta) or delta.dtype != x.dtype):
        delta = delta.reshape(rows, d).to(x.dtype).contiguous()
    fn = lib.rms_norm_f32 if x.dtype == torch.float32 else lib.rms_norm_bf16
    ldx, ldd = x.stride(0), 0 if delta is None else delta.stride(0)
    xp, wp, op = x.data_ptr(), weight.data_ptr(), out.data_ptr()
    dp = None if delta is None else delta.data_ptr()
    es = x.element_size()

    def part(lo: int, hi: int) -> int:
        fn(xp + lo * ldx * es, ldx, None if dp is None else dp + lo * ldd * es, ldd, wp, eps,
           op + lo * d * es, d, hi - lo, d)
        return 0

    _by_rows(rows, part, "rms_norm")
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [rows, 2n] projection (gate first) -> [rows, n]."""
    lib = load()
    assert lib is not None and _rows_ok(gate_up)
    rows, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    fn = lib.silu_mul_f32 if gate_up.dtype == torch.float32 else lib.silu_mul_bf16
    ldg, es = gate_up.stride(0), gate_up.element_size()
    gp, op = gate_up.data_ptr(), out.data_ptr()

    def part(lo: int, hi: int) -> int:
        fn(gp + lo * ldg * es, ldg, op + lo * n * es, n, hi - lo, n)
        return 0

    _by_rows(rows, part, "silu_mul")
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """In place: x [rows, heads, d] (heads contiguous within a row) becomes
    x * cos + rotate_half(x) * sin, as `layers.apply_rotary` computes it; cos and
    signed_sin [rows, d] (or [rows, 1, d]) contiguous in x's dtype. Returns x."""
    lib = load()
    rows, heads, d = x.shape
    assert lib is not None and x.stride(2) == 1 and x.stride(1) == d and d <= MAX_HEAD_DIM
    cos, signed_sin = cos.reshape(rows, d), signed_sin.reshape(rows, d)
    assert cos.is_contiguous() and signed_sin.is_contiguous() and cos.dtype == x.dtype
    fn = lib.rotary_f32 if x.dtype == torch.float32 else lib.rotary_bf16
    ldx, xp, cp, sp = x.stride(0), x.data_ptr(), cos.data_ptr(), signed_sin.data_ptr()
    es = x.element_size()

    def part(lo: int, hi: int) -> int:
        fn(xp + lo * ldx * es, ldx, heads, d, cp + lo * d * es, sp + lo * d * es, d, hi - lo)
        return 0

    _by_rows(rows, part, "rotary")
    return x


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                    torch.Tensor] | None:
    """(argmax, max, logsumexp) of each row of float32 logits [rows, vocab] in one C call
    (greedy sampling with the sampled token's logprob = max - logsumexp), or None where
    PyTorch's ops must do it: no library, not a CPU float32 matrix of unit-stride rows,
    or a row holding NaN or an infinity (their semantics are PyTorch's to keep)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.shape[0] == 0 or logits.shape[1] == 0 or logits.stride(1) != 1
            or logits.requires_grad):
        return None
    lib = load()
    if lib is None:
        return None
    rows, n = logits.shape
    idx = torch.empty(rows, dtype=torch.int64)
    top = torch.empty(rows, dtype=torch.float32)
    lse = torch.empty(rows, dtype=torch.float32)
    bad = torch.empty(rows, dtype=torch.int32)
    lib.argmax_logsumexp_f32(logits.data_ptr(), logits.stride(0), rows, n, idx.data_ptr(),
                             top.data_ptr(), lse.data_ptr(), bad.data_ptr())
    if bool(bad.any()):
        return None
    return idx, top, lse


#: From this many rows the KV cache write goes through `scatter_rows`; below it
#: index_copy_ is as fast (its fixed cost is lower), above it a parallel index_copy_ waits
#: for threads. Measurements: docs/benchmarks.md, "Engine constants".
SCATTER_MIN_ROWS = 32


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> bool:
    """dst[index[t]] = src[t] for every t, as `dst.index_copy_(0, index, src)` (the KV
    cache write of a step), in one C call of a memcpy a row, single-threaded. dst: contiguous
    [slots, ...]; src: [t, ...] of dst's dtype whose rows are contiguous (any row
    stride); index: int64 [t]. False, with nothing done, where it does not apply (no
    library, other layouts, dtypes or devices: the caller uses index_copy_); IndexError
    for an index outside dst."""
    if (dst.device.type != "cpu" or src.device.type != "cpu" or src.dtype != dst.dtype
            or not dst.is_contiguous() or index.dtype != torch.int64 or index.dim() != 1
            or src.shape[0] != index.shape[0] or src.shape[1:] != dst.shape[1:]
            or src.requires_grad or dst.requires_grad):
        return False
    if src.shape[0] == 0:
        return True
    if not src[0].is_contiguous():
        return False
    lib = load()
    if lib is None:
        return False
    index = index.contiguous()
    row_bytes = src[0].numel() * src.element_size()
    _check_slots(lib.scatter_rows(src.data_ptr(), src.stride(0) * src.element_size(),
                                  dst.data_ptr(), row_bytes, index.data_ptr(), index.shape[0],
                                  dst.shape[0]), index, dst.shape[0])
    return True


def _check_slots(bad: int, index: torch.Tensor, num_slots: int) -> None:
    """A scatter kernel's return: 0, or the (1-based) row whose slot is out of range."""
    if bad:
        raise IndexError(f"index {int(index[bad - 1])} is out of range for a cache of "
                         f"{num_slots} slots")


def scatter_int8_rows(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor,
                      src: torch.Tensor) -> bool:
    """The int8 KV write in one C call: codes[index[t]], scales[index[t]] = the int8 codes
    and scales of src[t] per head, exactly as `kv_quant.quantize` (then index_copy_)
    makes them. codes: contiguous int8 [slots, heads, d]; scales: contiguous float32
    [slots, heads]; src: float32 or bfloat16 [t, heads, d], heads d apart within a row;
    index: int64 [t]. False, with nothing done, where it does not apply (the caller
    quantizes with PyTorch); IndexError for an index outside the cache."""
    if (src.dim() != 3 or src.shape[1:] != codes.shape[1:] or codes.dtype != torch.int8
            or scales.dtype != torch.float32 or src.dtype not in (torch.float32, torch.bfloat16)
            or not codes.is_contiguous() or not scales.is_contiguous()
            or src.stride(2) != 1 or src.stride(1) != src.shape[2]
            or index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] != src.shape[0]
            or src.device.type != "cpu" or codes.device.type != "cpu" or src.requires_grad):
        return False
    lib = load()
    if lib is None:
        return False
    index = index.contiguous()
    _check_slots(lib.scatter_int8_rows(
        src.data_ptr(), src.stride(0), int(src.dtype == torch.bfloat16), codes.data_ptr(),
        scales.data_ptr(), src.shape[1], src.shape[2], index.data_ptr(), index.shape[0],
        codes.shape[0]), index, codes.shape[0])
    return True
