"""Matmul paths on this CPU for SmolLM2-135M's shapes: what a decode step can reach.

    .venv/bin/python benchmarks/matmul_bench.py --json [--threads 2]

For each projection of the model (fused QKV, o_proj, fused gate/up, down_proj, lm_head)
and 1, 4, 16, 64 and 512 rows, the time of y = x W^T by:

- fp32 `F.linear` (PyTorch's default CPU GEMM, MKL),
- fp32 `engine.models.layers.linear` (what the engine runs: the C kernel for
  `KERNEL_MIN_ROWS..KERNEL_MAX_ROWS` rows, oneDNN from `ONEDNN_MIN_ROWS`, else (W x^T)^T
  up to 64 rows),
- `engine.linear_kernel.small_linear` (the C kernel, AVX-512 or AVX2 + FMA, at every row
  count; absent where it cannot be built) with fp32 weights (`fp32_kernel`), bf16 weights
  and activations (`bf16_kernel`) and int8 weights with bf16 activations (`int8_kernel`),
- fp32 oneDNN (`torch._C._nn.mkldnn_linear` on oneDNN tensors),
- bf16 `F.linear` (oneDNN, AVX512_BF16 dot products where the CPU has them, emulated
  elsewhere), bf16 `engine.models.layers.linear` (`bf16_engine`: the kernel or oneDNN or
  a widened fp32 GEMM, by rows and CPU) and that fp32 GEMM of widened copies
  (`bf16_widened`: `F.linear(x.float(), w.float()).bfloat16()`),
- int8 weight-only `torch._weight_int8pack_mm` (per-output-channel scales; fp32 and bf16
  activations) and `engine.models.layers.int8_linear` (`int8_engine`, bf16 activations:
  the kernel for few rows).

Each is reported as GFLOP/s and as GB/s of weight bytes streamed, against the machine's
measured peaks: a 2048^3 GEMM in fp32 and bf16 (compute) and a 1 GiB reduction (memory
read bandwidth). At 1-64 rows a projection is memory-bound (the weights are read once
per step), so GB/s against the bandwidth is the number to watch. `step_floor_ms` sums
one decoder step's matmuls (30 layers + lm_head) per path: the floor a decode step of
that many sequences cannot go below on that path. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from bench_common import machine, median_seconds, progress_log, read_bandwidth_gbs  # noqa: I001  (sets the OpenMP policy before torch)
# isort: split
import torch
import torch.nn.functional as F

from ridgeline.engine.kernels import linear_kernel
from ridgeline.engine.model_executor.models.layers import int8_linear  # noqa: E402
from ridgeline.engine.model_executor.models.layers import linear as engine_linear  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 576, 1536, 9, 3, 64, 30, 49152
SHAPES = {  # name: (out_features, in_features)
    "qkv": (HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down_proj": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
ROWS = (1, 4, 16, 64, 512)


def peaks() -> dict[str, float]:
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(2048, 2048).to(dt)
        b = torch.randn(2048, 2048).to(dt)
        t = median_seconds(lambda: torch.mm(a, b), reps=3)
        out[f"{name}_gflops"] = round(2 * 2048 ** 3 / t / 1e9, 1)
    out["read_gbs"] = read_bandwidth_gbs()
    return out


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def paths(w: torch.Tensor) -> dict[str, tuple[Callable[[torch.Tensor], object], torch.dtype, int]]:
    """name -> (fn(x), activation dtype, bytes of weights read per call)."""
    wb = w.to(torch.bfloat16)
    wq, scale = quantize(w)
    sb = scale.to(torch.bfloat16)
    out: dict[str, tuple[Callable[[torch.Tensor], object], torch.dtype, int]] = {
        "fp32_mkl": (lambda x: F.linear(x, w), torch.float32, w.numel() * 4),
        "fp32_engine": (lambda x: engine_linear(x, w), torch.float32, w.numel() * 4),
        "bf16": (lambda x: F.linear(x, wb), torch.bfloat16, w.numel() * 2),
        "bf16_engine": (lambda x: engine_linear(x, wb), torch.bfloat16, w.numel() * 2),
        "bf16_widened": (lambda x: F.linear(x.float(), wb.float()).bfloat16(), torch.bfloat16,
                         w.numel() * 2),
        "int8_fp32act": (lambda x: torch._weight_int8pack_mm(x, wq, scale), torch.float32,
                         w.numel() + scale.numel() * 4),
        "int8_bf16act": (lambda x: torch._weight_int8pack_mm(x, wq, sb), torch.bfloat16,
                         w.numel() + scale.numel() * 2),
        "int8_engine": (lambda x: int8_linear(x, wq, sb), torch.bfloat16,
                        w.numel() + scale.numel() * 2),
    }
    if linear_kernel.available():
        out["fp32_kernel"] = (lambda x: linear_kernel.small_linear(x, w), torch.float32,
                              w.numel() * 4)
        out["bf16_kernel"] = (lambda x: linear_kernel.small_linear(x, wb), torch.bfloat16,
                              w.numel() * 2)
        out["int8_kernel"] = (lambda x: linear_kernel.small_linear(x, wq, scales=sb),
                              torch.bfloat16, w.numel() + scale.numel() * 2)
    try:
        wm = w.to_mkldnn()
        torch._C._nn.mkldnn_linear(torch.randn(2, w.shape[1]).to_mkldnn(), wm, None)
        out["fp32_onednn"] = (lambda x: torch._C._nn.mkldnn_linear(x, wm, None),
                              torch.float32, w.numel() * 4)
    except (RuntimeError, AttributeError):
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    log = progress_log(args.json)
    torch.manual_seed(0)
    log("peaks ...")
    peak = peaks()
    results: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    floor: dict[str, dict[str, float]] = {}
    for name, (n_out, n_in) in SHAPES.items():
        w = torch.randn(n_out, n_in) * 0.02
        results[name] = {}
        for path, (fn, dt, wbytes) in paths(w).items():
            results[name][path] = {}
            for m in args.rows:
                x = torch.randn(m, n_in).to(dt)
                if path == "fp32_onednn":
                    x = x.to_mkldnn()
                with torch.inference_mode():  # as the engine runs (some paths need it)
                    t = median_seconds(lambda: fn(x))
                flops = 2 * m * n_out * n_in
                results[name][path][str(m)] = {
                    "us": round(t * 1e6, 1), "gflops": round(flops / t / 1e9, 1),
                    "weight_gbs": round(wbytes / t / 1e9, 2)}
                per_step = t * (1 if name == "lm_head" else LAYERS)
                floor.setdefault(path, {})
                floor[path][str(m)] = floor[path].get(str(m), 0.0) + per_step * 1e3
            log(f"{name} {path}: " + ", ".join(
                f"{m}:{results[name][path][str(m)]['us']}us" for m in args.rows))
    out = {"benchmark": "matmul", "threads": args.threads, "peaks": peak,
           "shapes": {k: list(v) for k, v in SHAPES.items()}, "results": results,
           "step_floor_ms": {p: {m: round(v, 2) for m, v in d.items()} for p, d in floor.items()},
           "machine": machine(args.threads), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(out, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
