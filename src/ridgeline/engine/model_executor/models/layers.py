"""Building blocks shared by every model: linear layers with uninitialised (to be loaded)
weights, RMSNorm and rotary embeddings. Numerics follow transformers' float32 formulas so
that greedy outputs match it token for token."""

from __future__ import annotations

import functools
import logging
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ridgeline.engine.kernels import cpu_kernels, decode_ops, linear_kernel

log = logging.getLogger(__name__)

#: On CPU in float32, x W^T for 2..SMALL_BATCH_ROWS rows is computed as (W x^T)^T: MKL's
#: kernel for a short x and a wide W runs at a fraction of memory bandwidth, while W x^T
#: (many rows, few columns) streams W once; from 128 rows the plain product is faster.
#: bfloat16 goes to oneDNN, faster at every size. Measurements: docs/benchmarks.md, "Engine constants".
SMALL_BATCH_ROWS = 64


#: From this many rows a CPU float32 matmul goes to oneDNN with the weight kept in its
#: blocked layout (packed once, again only after the weight changes); below it the
#: (W x^T)^T path is faster. The call is `mkldnn._linear_pointwise` (what inductor's
#: frozen CPU graphs call): a dense x and y, so no conversion of either. bfloat16
#: products above the C kernel's rows take it too where the CPU has native bf16 dot
#: products (bit-identical to F.linear). Measurements: docs/benchmarks.md, "Engine constants".
ONEDNN_MIN_ROWS = 10
_onednn_weights: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
_onednn_lock = threading.Lock()


def _onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's packed layout, cached per tensor and version (an in-place
    update, e.g. RL's update_weights, bumps the version and it is packed again)."""
    key = id(weight)
    with _onednn_lock:
        hit = _onednn_weights.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        for k in [k for k, (ref, _, _) in _onednn_weights.items() if ref() is None]:
            del _onednn_weights[k]
        _onednn_weights[key] = (weakref.ref(weight), weight._version, packed)
        return packed


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _onednn_weight(weight), bias,
                                              "none", [], "")


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """Whether the packed oneDNN call (present where `_ONEDNN`) runs and agrees with
    F.linear here: a private op of torch's, checked once per dtype on a small product, so
    a CPU or build where it fails keeps PyTorch's path, with a warning, instead of failing
    a step."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ONEDNN_MIN_ROWS + 7, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(w, None), b, "none", [], "")
        ok = torch.allclose(got.float(), F.linear(x.float(), w.float(), b.float()),
                            rtol=2e-2, atol=5e-2)
    except RuntimeError as e:
        log.warning("oneDNN's packed linear failed here (%s); using PyTorch's matmuls", e)
        return False
    if not ok:
        log.warning("oneDNN's packed linear disagrees with F.linear here; using PyTorch's "
                    "matmuls")
    return ok


_ONEDNN = (torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_linear_pointwise")
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))

#: CPU products of KERNEL_MIN_ROWS..KERNEL_MAX_ROWS rows with float32 or bfloat16 weights
#: (and int8 ones: `int8_linear`) go to the C kernel of `engine.linear_kernel` where it
#: builds (AVX-512 or AVX2 + FMA): it streams each weight once for all rows. One row goes
#: here too: a row's result is the same whether it is computed alone (a standard step) or
#: among a speculative verify's rows. Measurements (`benchmarks/matmul_bench.py`, AVX-512
#: and AVX2): docs/benchmarks.md, "Engine constants".
KERNEL_MIN_ROWS = 1
KERNEL_MAX_ROWS = 16
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)

#: Without AVX512_BF16 or AMX oneDNN emulates bfloat16 matmuls, slowly: there bfloat16
#: products of more than KERNEL_MAX_ROWS rows go to the kernel up to BF16_KERNEL_MAX_ROWS
#: rows and from there to a float32 GEMM of widened copies (x and W widened per call).
#: Measurements (Zen 3): docs/benchmarks.md, "Engine constants".
_BF16_NATIVE = bool({"avx512_bf16", "amx_bf16"} & cpu_kernels.cpu_flags())
BF16_KERNEL_MAX_ROWS = 128

#: Where the kernel multiplies bf16 by vdpbf16ps (`linear_kernel.bf16_dot()`), bf16
#: products go to it up to this many rows and to oneDNN beyond: oneDNN's bf16 call has a
#: large fixed cost and grows slowly with rows; the two meet near 64 rows. Up to 64 rows every decode
#: pass of a 64-sequence batch can run as one `decode_stack` call. Measurements (Zen 4):
#: docs/benchmarks.md, "Engine constants".
BF16_DOT_KERNEL_MAX_ROWS = 64
#: int8 weights times bf16 where the kernel has the dot path: every row count (see below)
INT8_DOT_KERNEL_MAX_ROWS = 1 << 30


@functools.cache
def _kernel_bf16_dot() -> bool:
    return linear_kernel.bf16_dot()


def kernel_max_rows(dtype: torch.dtype, int8: bool = False) -> int:
    """The most rows of a product with `dtype` activations that `linear` (float weights)
    or `int8_linear` (`int8`) gives the kernel. int8 weights times bf16 with the dot path
    (converted to bf16 in registers, exactly): the kernel at any size, since it beat
    torch's int8 GEMM at every size measured (docs/benchmarks.md, "Engine constants")."""
    if int8:
        dot = dtype == torch.bfloat16 and _kernel_bf16_dot()
        return INT8_DOT_KERNEL_MAX_ROWS if dot else KERNEL_MAX_ROWS
    if dtype != torch.bfloat16:
        return KERNEL_MAX_ROWS
    if not _BF16_NATIVE:
        return BF16_KERNEL_MAX_ROWS
    return BF16_DOT_KERNEL_MAX_ROWS if _kernel_bf16_dot() else KERNEL_MAX_ROWS


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  max_rows: int) -> bool:
    return (KERNEL_MIN_ROWS <= x.shape[0] <= max_rows and x.dim() == 2
            and x.dtype in _KERNEL_DTYPES and x.is_cpu
            and weight.is_contiguous()
            and (bias is None or (bias.dtype in _KERNEL_DTYPES and bias.is_contiguous()))
            and not torch.is_grad_enabled() and linear_kernel.load() is not None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear for a flat batch [T, in] -> [T, out], with the C kernel, small-batch and
    oneDNN CPU paths for float32 and bfloat16."""
    rows = x.shape[0]
    if weight.dtype == x.dtype and _kernel_takes(x, weight, bias, kernel_max_rows(x.dtype)):
        return linear_kernel.small_linear(x, weight, bias)
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and not _BF16_NATIVE
            and x.device.type == "cpu" and not torch.is_grad_enabled()):
        return F.linear(x.float(), weight.float(),
                        None if bias is None else bias.float()).to(torch.bfloat16)
    if (_ONEDNN and rows >= ONEDNN_MIN_ROWS and x.dim() == 2 and x.device.type == "cpu"
            and weight.dtype == x.dtype
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and _BF16_NATIVE))
            and (bias is None or bias.dtype == x.dtype) and not torch.is_grad_enabled()
            and not weight.is_inference()  # the packed copy is keyed by its version
            and _onednn_works(x.dtype)):
        return _onednn_linear(x, weight, bias)
    if (1 < rows <= SMALL_BATCH_ROWS and x.dim() == 2 and x.device.type == "cpu"
            and x.dtype == torch.float32):
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q [out, in] int8, scale [out] float32) with
    weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias) with W = qweight * scales (per output channel), in x's dtype: the C
    kernel for KERNEL_MIN_ROWS..kernel_max_rows(x.dtype, int8=True) rows where it builds,
    else PyTorch's weight-only int8 GEMM (both read a quarter of the fp32 weight bytes;
    measurements: docs/benchmarks.md, "Engine constants")."""
    if _kernel_takes(x, qweight, bias, kernel_max_rows(x.dtype, int8=True)):
        return linear_kernel.small_linear(x, qweight, bias, scales=scales)
    out = torch._weight_int8pack_mm(x.contiguous(), qweight, scales)
    return out if bias is None else out.add_(bias)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [rows, 2n] gate/up projection (gate first) -> [rows, n]:
    one C call where `decode_ops` takes it, PyTorch's three ops otherwise."""
    if gate_up.dim() == 2 and gate_up.stride(1) == 1 and decode_ops.usable(gate_up):
        return decode_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Linear(nn.Module):
    """y = x W^T + b, with W allocated but not initialised: weights are always loaded.
    After `quantize_int8()` W is int8 with a scale per output channel (weight-only; the
    float weight is freed)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.register_buffer("qweight", None, persistent=False)
        self.register_buffer("scales", None, persistent=False)

    def quantize_int8(self) -> None:
        q, scale = quantize_int8(self.weight)
        self.qweight = q
        self.scales = scale.to(self.weight.dtype)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return int8_linear(x, self.qweight, self.scales, self.bias)
        return linear(x, self.weight, self.bias)


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one projection (the dense
    MLP of every family; a MoE layer's shared experts are one too)."""

    def __init__(self, hidden: int, inter: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias, dtype, device)
        self.down_proj = Linear(inter, hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))

    def quantize_int8(self) -> None:
        self.gate_up_proj.quantize_int8()
        self.down_proj.quantize_int8()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of x; with `delta`, of x + delta, and x itself becomes x + delta (the
        residual add before the norm, fused where `decode_ops` takes x)."""
        if x.dim() == 2 and x.stride(1) == 1 and decode_ops.usable(x):
            return decode_ops.rms_norm(x, self.weight, self.eps, delta)
        if delta is not None:
            x.add_(delta)
        if x.dtype == torch.float32:  # one kernel, bit-identical to the formula below
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # same order of operations as transformers' LlamaRMSNorm (compute in float32)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_len, looked up by position. The sine
    table's first half is negated so that rotate_half(x) * sin becomes a plain product
    with the halves of x swapped."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * attention_scaling).to(dtype)
        sin = (emb.sin() * attention_scaling).to(dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin as [T, 1, head_dim], to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] -> x*cos + rotate_half(x)*sin, rounded exactly as transformers
    computes it ((-a)*b == -(a*b) and x + -y == x - y in floating point)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * cos
    out.add_(swapped * signed_sin)
    return out
