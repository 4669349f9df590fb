"""A C kernel for y = x W^T (+ b) on CPU when x has a handful of rows (csrc/small_linear.c).

A decode step of one sequence multiplies 1 row by each weight; a speculative verify 2..8
rows. MKL's GEMM is built for the first (gemv) and for large batches, and is several times
slower in between, though memory bounds both; oneDNN's bfloat16 matmul is emulated on CPUs
without AVX512_BF16. This kernel streams each weight row once, in PyTorch's [out, in]
layout as stored (no repacking, so in-place weight updates need nothing), and computes a
tile of rows of x against a few weight rows from registers, in float32 whatever the
storage: weights float32, bfloat16 or int8 with a float scale per output channel
(`layers.quantize_int8`'s layout); x float32 or bfloat16, y in x's dtype (rounded as
`.to(torch.bfloat16)`); an optional bias. bfloat16 x with bfloat16 or int8 weights on
AVX512_BF16 multiplies by vdpbf16ps (exact bf16 products), not widened.

Two variants of one source: AVX-512 F (16 lanes) and AVX2 + FMA (8 lanes). `load()` builds
the one the CPU allows; `portable_library()` the AVX2 one on an AVX-512 CPU too (tests).
Every output is summed in the same order whatever the number of rows and its tile (and
built with -ffp-contract=off), so a row's result does not depend on the rows beside it; the
two variants agree to rounding, not bit for bit. Threads are the library's own pthreads:
they claim column chunks from a shared counter and, after a call, spin for `spin_us` before
sleeping on a futex (a Python pool's hand-off costs as much as a whole call). Built on
first use (`kernel_build`); without AVX-512 or AVX2 + FMA, Linux or a compiler
`available()` is False and callers keep their PyTorch path.
Measurements: docs/benchmarks.md, "Engine C kernels".
"""
from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from ridgeline.engine.kernels import kernel_build

log = logging.getLogger(__name__)

#: How long (microseconds) the helper threads wait awake for the next call before they
#: sleep. The gaps between the matmuls of a forward pass are a few to tens of us.
SPIN_US = 200

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
          "-lpthread"]
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}

def _build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    target = kernel_build.compile_library(
        "small_linear", kernel_build.read_source("small_linear"), [[*_FLAGS, *extra_flags]])
    if target is None:
        return None
    lib = ctypes.CDLL(str(target))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.linear_run.argtypes = [ptr, i64, c_int, ptr, i64, c_int, ptr, c_int, ptr, c_int, ptr,
                               i64, c_int, i64, i64, i64, c_int]
    lib.linear_run.restype = c_int
    lib.linear_set_spin_us.argtypes = [c_int]
    lib.linear_set_spin_us.restype = None
    lib.linear_vector_width.argtypes = []
    lib.linear_vector_width.restype = c_int
    lib.linear_bf16_dot.argtypes = []
    lib.linear_bf16_dot.restype = c_int
    if not lib.linear_vector_width():
        return None
    lib.linear_set_spin_us(SPIN_US)
    return lib


def _runs_avx2() -> bool:
    flags = kernel_build.cpu_flags()
    return sys.platform.startswith("linux") and "avx2" in flags and "fma" in flags


def _build_for_this_cpu() -> ctypes.CDLL | None:
    # the helpers wait on futexes; the tiles need AVX-512 F or AVX2 + FMA
    if _runs_avx2() or (sys.platform.startswith("linux")
                        and "avx512f" in kernel_build.cpu_flags()):
        return _build()
    return None


#: The compiled kernel for this CPU (the AVX-512 variant where it has AVX-512 F, else the
#: AVX2 one), or None where it cannot be built or run (neither ISA, not Linux, no C
#: compiler).
load = kernel_build.LazyLibrary(_build_for_this_cpu)


@functools.cache
def portable_library() -> ctypes.CDLL | None:
    """The AVX2 variant (`-mno-avx512f`), for tests and benchmarks on a machine that has
    AVX-512; the same library as `load()` on one that has not. None where the CPU lacks
    AVX2 + FMA or nothing builds. The engine always uses `load()`."""
    if not _runs_avx2():
        return None
    if "avx512f" not in kernel_build.cpu_flags():
        return load()
    return _build(("-mno-avx512f",))


def available() -> bool:
    return load() is not None


def vector_width(lib: ctypes.CDLL | None = None) -> int:
    """Floats per vector in the kernel as compiled (16: AVX-512, 8: AVX2; 0: none)."""
    lib = lib if lib is not None else load()
    return lib.linear_vector_width() if lib is not None else 0


def bf16_dot(lib: ctypes.CDLL | None = None) -> bool:
    """Whether bf16 x times bf16 or int8 weights run on vdpbf16ps here (AVX512_BF16), not
    widened."""
    lib = lib if lib is not None else load()
    return bool(lib is not None and lib.linear_bf16_dot())


def set_spin_us(us: int) -> None:
    """How long the helper threads stay awake after a call (0: sleep at once)."""
    lib = load()
    if lib is not None:
        lib.linear_set_spin_us(int(us))


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 threads: int | None = None, *, scales: torch.Tensor | None = None,
                 lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (* scales [N]) (+ bias [N]) -> new contiguous [M, N] in
    x's dtype, on CPU.

    x: float32 or bfloat16, any row stride (unit stride within rows; other layouts are
    copied). weight: contiguous float32, bfloat16 or int8; int8 needs `scales` (float32 or
    bfloat16, one per output channel, as `layers.quantize_int8` makes them), the others
    take none. bias: contiguous float32 or bfloat16. threads: default
    torch.get_num_threads(). lib: a variant other than `load()`'s (`portable_library()`).
    Raises ValueError for shapes or dtypes it does not take (callers check first) and
    RuntimeError when the kernel is not available."""
    lib = lib if lib is not None else load()
    if lib is None:
        raise RuntimeError("the small-batch linear kernel is not available here")
    # checked in one expression: this runs ~120 times a decode step
    xs, ws, xc, wc = x.shape, weight.shape, _CODES.get(x.dtype, 9), _CODES.get(weight.dtype, 9)
    sc = 0 if scales is None else _CODES.get(scales.dtype, 9)
    bc = 0 if bias is None else _CODES.get(bias.dtype, 9)
    if not (len(xs) == 2 and len(ws) == 2 and xs[1] == ws[1] and xs[0] > 0 and xs[1] > 0
            and ws[0] > 0 and xc < 2 and wc < 3 and sc < 2 and bc < 2 and x.is_cpu
            and weight.is_cpu and weight.is_contiguous() and (wc == 2) == (scales is not None)
            and (scales is None or (scales.shape == ws[:1] and scales.is_contiguous()
                                    and scales.is_cpu))
            and (bias is None or (bias.shape == ws[:1] and bias.is_contiguous()
                                  and bias.is_cpu))):
        raise ValueError(
            "small_linear takes CPU x [M, K] (float32 or bfloat16), a contiguous weight "
            "[N, K] (float32, bfloat16, or int8 with scales [N]) and a contiguous bias [N] "
            f"(float32 or bfloat16); got x {tuple(xs)} {x.dtype}, weight {tuple(ws)} "
            f"{weight.dtype}, bias {None if bias is None else (tuple(bias.shape), bias.dtype)}"
            f", scales {None if scales is None else (tuple(scales.shape), scales.dtype)}")
    m, k = xs
    n = ws[0]
    ldx = x.stride()
    if ldx[1] != 1 or (m > 1 and ldx[0] < k):
        x = x.contiguous()
        ldx = (k, 1)
    out = torch.empty(m, n, dtype=x.dtype)
    rc = lib.linear_run(
        x.data_ptr(), ldx[0] if m > 1 else k, xc, weight.data_ptr(), k, wc,
        None if scales is None else scales.data_ptr(), sc,
        None if bias is None else bias.data_ptr(), bc, out.data_ptr(), n, xc, m, n, k,
        torch.get_num_threads() if threads is None else threads)
    if rc:
        raise RuntimeError(f"small_linear kernel failed ({rc})")
    return out
