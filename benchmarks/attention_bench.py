"""The C decode-attention kernel against its previous version, same run, same inputs.

    .venv/bin/python benchmarks/attention_bench.py --json              # ~1 min
    .venv/bin/python benchmarks/attention_bench.py --quick --json      # 2 contexts, 5 rounds
    .venv/bin/python benchmarks/attention_bench.py --json --portable   # + the 8-wide build
    .venv/bin/python benchmarks/attention_bench.py --prefill --json    # prefill: ~1 min

One call is one layer of a decode step: 48 sequences of one new token each attending to
their paged context, with SmolLM2-135M's attention shape (9 query heads over 3 KV heads,
head_dim 64, block_size 16). Contexts: a decode-like mix (uniform 300-600 tokens, mean
~450) and uniform 128, 512 and 2048 tokens; KV stored as float32, bfloat16 and int8 (codes
and per-token scales). Blocks are scattered over the pool as the block manager leaves
them.

The baseline is the kernel as of `BASELINE_COMMIT`, read with `git show` and compiled in
this run (the same compiler and flags its own source asked for). Each configuration keeps
enough distinct layers that one pass over them reads at least `--pool-mb` of KV, so, as
in a real step where 30 layers each have their own KV, the blocks come from memory, not
from a cache a single repeated layer would sit in. Old and new alternate round by round;
a round times one pass over all layers; reported per call: the minimum (least disturbed
by other processes on the machine) and the median over rounds, on one thread (the
kernel alone) and on `--threads` threads (the engine's split). `kv_gbs` is the KV bytes
one call reads over the minimum time, to set against the machine's read bandwidth
(matmul_bench's `read_gbs`). `max_abs_diff` is between the two kernels' outputs.
With `--portable`, the kernel's portable path (`cpu_kernels.portable_library()`, what CPUs
with neither AVX-512 nor AVX2 + FMA build) is timed too (`portable_ms_min`,
`speedup_vs_portable_min`), and so is the AVX2 path (`cpu_kernels.avx2_library()`,
`avx2_ms_min`) where this CPU runs it but builds another natively (AVX-512); `new` is the
native build, whose path `machine.kernel_path` names. Prints one JSON object.

With `--prefill`: the C prefill kernel (`cpu_kernels.paged_prefill_attention`) against
PyTorch's SDPA as the engine ran it for fresh prompts (one causal call per prompt over its
own keys/values), SmolLM2's shape, model and KV in float32 and in bfloat16: one prompt of
64, 512 or 2048 tokens, and a batch of 16 prompts of 64-512 tokens. The two alternate
round by round (`--rounds`), each round a few calls; reported per call: min and median ms
and GFLOP/s over the causal half of the score matrix (4 * heads * head_dim * n(n+1)/2 per
prompt; the work either side actually does is larger), on `--threads` threads, and
`max_abs_diff` between their outputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

from bench_common import cpu_info, machine, progress_log  # noqa: I001  (sets the OpenMP policy before torch)
# isort: split
import torch

from ridgeline.engine.kernels import cpu_kernels
from ridgeline.engine.model_executor.kv_quant import quantize  # noqa: E402

#: The last commit with only the 8-wide kernel (a horizontal sum per row and query vector).
BASELINE_COMMIT = "08ade13ce041da0f21bb3310b3998a81532d25f9"
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, SEQS = 9, 3, 64, 16, 48
CONTEXTS: dict[str, tuple[int, int]] = {  # name: (min, max) context length
    "mixed_300_600": (300, 600), "128": (128, 128), "512": (512, 512), "2048": (2048, 2048),
    "300_400": (300, 400), "900_1100": (900, 1100)}
STORAGES = ("float32", "bfloat16", "int8")


#: Where the kernel's wrapper and C source lived over the history (newest first).
WRAPPER_PATHS = ("src/ridgeline/engine/kernels/cpu_kernels.py",
                 "src/ridgeline/engine/cpu_kernels.py")
SOURCE_PATHS = ("src/ridgeline/engine/kernels/csrc/paged_attention.c",
                "src/ridgeline/engine/csrc/paged_attention.c")


def _git_show(root: Path, commit: str, paths: tuple[str, ...]) -> str | None:
    for path in paths:
        done = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root,
                              capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
    return None


def baseline_module(commit: str = BASELINE_COMMIT) -> types.ModuleType:
    """cpu_kernels as of `commit`, as a separate module (its own compiled .so): the
    commit's wrapper, and its C source where that was a file of its own (the wrapper
    would otherwise read today's). Engine imports are mapped to today's modules."""
    root = Path(__file__).resolve().parent.parent
    try:
        source = _git_show(root, commit, WRAPPER_PATHS)
    except OSError as e:
        sys.exit(f"attention_bench needs git for its baseline ({e})")
    if source is None:
        sys.exit(f"no cpu_kernels.py at {commit[:12]} (is this a clone with its history?)")
    c_source = _git_show(root, commit, SOURCE_PATHS)
    source = re.sub(r"from ridgeline\.engine import (\w+)",
                    r"from ridgeline.engine.kernels import \1", source)
    module = types.ModuleType("ridgeline_attention_baseline")
    if c_source is not None:  # the commit's C, not what read_source finds today
        source = source.replace('kernel_build.read_source("paged_attention")',
                                "_BASELINE_C_SOURCE")
        module.__dict__["_BASELINE_C_SOURCE"] = c_source
    exec(compile(source, f"{commit[:7]}:cpu_kernels.py", "exec"),  # noqa: S102
         module.__dict__)
    return module


class Layers:
    """`count` layers of paged KV for one configuration, and one decode call's inputs."""

    def __init__(self, storage: str, ctx: list[int], pool_mb: float, seed: int,
                 q_dtype: torch.dtype = torch.float32) -> None:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.ctx = ctx
        blocks = [-(-c // BLOCK_SIZE) for c in ctx]
        num_blocks = 1 + sum(blocks)
        elem = {"float32": 4, "bfloat16": 2, "int8": 1}[storage]
        per_layer = 2 * num_blocks * BLOCK_SIZE * KV_HEADS * (HEAD_DIM * elem
                                                             + (4 if storage == "int8" else 0))
        self.count = max(2, int(pool_mb * 2 ** 20 / per_layer) + 1)
        self.flops = 4 * HEADS * HEAD_DIM * sum(ctx)  # q.K and P.V, 2 flops a MAC
        self.read_bytes = sum(2 * c * KV_HEADS * (HEAD_DIM * elem + (4 if storage == "int8"
                                                                      else 0)) for c in ctx)
        shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.kv: list[tuple[torch.Tensor, ...]] = []
        for _ in range(self.count):
            k, v = torch.randn(shape), torch.randn(shape)
            if storage == "int8":
                (kq, ks), (vq, vs) = quantize(k, "int8"), quantize(v, "int8")
                self.kv.append((kq, vq, ks, vs))
            elif storage == "bfloat16":
                self.kv.append((k.bfloat16(), v.bfloat16()))
            else:
                self.kv.append((k, v))
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(nb)] for nb in blocks]
        width = max(blocks)
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.q_start = torch.arange(len(ctx))
        self.q_len = torch.ones(len(ctx), dtype=torch.long)
        self.ctx_len = torch.tensor(ctx)
        qkv = torch.randn(len(ctx), HEADS + 2 * KV_HEADS, HEAD_DIM).to(q_dtype)
        self.q = qkv[:, :HEADS]  # strided, as the model passes it
        self.out = torch.empty(len(ctx), HEADS, HEAD_DIM, dtype=q_dtype)

    def call(self, module: Any, layer: int, cuts: list[int]) -> None:
        kv = self.kv[layer]
        scales = {"k_scale": kv[2], "v_scale": kv[3]} if len(kv) == 4 else {}
        module.paged_decode_attention(self.q, kv[0], kv[1], self.table, self.q_start,
                                      self.q_len, self.ctx_len, self.out, cuts=cuts, **scales)

    def output(self, module: types.ModuleType) -> torch.Tensor:
        self.call(module, 0, [0, len(self.ctx) * KV_HEADS])
        return self.out.float().clone()


def time_rounds(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each fn, the fns alternating round by round."""
    for fn in fns.values():
        fn()  # warm-up: first-touch of the output, the thread pool
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


class Build:
    """cpu_kernels called with one of its builds, in the baseline's interface."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def paged_decode_attention(self, *args: Any, **kwargs: Any) -> None:
        cpu_kernels.paged_decode_attention(*args, lib=self.lib, **kwargs)


def extra_builds(portable: bool) -> list[tuple[str, Any]]:
    """With --portable: the portable build, and the AVX2 one where it is not native."""
    if not portable:
        return []
    builds = [("portable", Build(cpu_kernels.portable_library()))]
    avx2 = cpu_kernels.avx2_library()
    if cpu_kernels.kernel_path() != "avx2" and cpu_kernels.kernel_path(avx2) == "avx2":
        builds.append(("avx2", Build(avx2)))
    return builds


def bench_config(old: types.ModuleType, storage: str, ctx: list[int], threads: int,
                 rounds: int, pool_mb: float, seed: int, portable: bool,
                 q_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    layers = Layers(storage, ctx, pool_mb, seed, q_dtype)
    items = len(ctx) * KV_HEADS
    result: dict[str, Any] = {
        "layers_cycled": layers.count, "kv_mb_per_call": round(layers.read_bytes / 2 ** 20, 2),
        "max_abs_diff": float((layers.output(old) - layers.output(cpu_kernels)).abs().max())}
    for n in sorted({1, threads}):
        cuts = [0, items] if n == 1 else cpu_kernels.split_work(ctx, KV_HEADS, n)
        kernels: list[tuple[str, Any]] = [("old", old), ("new", cpu_kernels),
                                          *extra_builds(portable)]
        fns = {name: (lambda m=module, c=cuts: [layers.call(m, i, c)
                                                 for i in range(layers.count)])
               for name, module in kernels}
        times = time_rounds(fns, rounds)
        row: dict[str, Any] = {}
        for name, per_round in times.items():
            per_call = [t / layers.count for t in per_round]
            row[f"{name}_ms_min"] = round(min(per_call) * 1e3, 3)
            row[f"{name}_ms_median"] = round(statistics.median(per_call) * 1e3, 3)
            row[f"{name}_kv_gbs"] = round(layers.read_bytes / min(per_call) / 1e9, 2)
            row[f"{name}_gflops_median"] = round(
                layers.flops / statistics.median(per_call) / 1e9, 1)
        row["speedup_min"] = round(row["old_ms_min"] / row["new_ms_min"], 2)
        row["speedup_median"] = round(row["old_ms_median"] / row["new_ms_median"], 2)
        if portable:
            row["speedup_vs_portable_min"] = round(row["portable_ms_min"] / row["new_ms_min"], 2)
        result[f"threads_{n}"] = row
    return result


PREFILL_CONFIGS: dict[str, list[int]] = {
    "prompt_64": [64], "prompt_512": [512], "prompt_2048": [2048],
    "batch16_64_512": [random.Random(16).randint(64, 512) for _ in range(16)]}


class Prefill:
    """One layer of a prefill step: fresh prompts of `lengths`, their K/V already in the
    paged cache (blocks scattered), and the same K/V as the flat tensors SDPA reads."""

    def __init__(self, dtype: torch.dtype, lengths: list[int], seed: int) -> None:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.lengths = lengths
        blocks = [-(-n // BLOCK_SIZE) for n in lengths]
        num_blocks = 1 + sum(blocks)
        free = list(range(1, num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(nb)] for nb in blocks]
        width = max(blocks)
        total = sum(lengths)
        qkv = torch.randn(total, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
        self.q = qkv[:, :HEADS]  # strided, as the model passes it
        self.k = qkv[:, HEADS:HEADS + KV_HEADS]
        self.v = qkv[:, HEADS + KV_HEADS:]
        self.k_cache = torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        start = 0
        for n, table in zip(lengths, tables):
            for b, blk in enumerate(table):
                rows = min(BLOCK_SIZE, n - b * BLOCK_SIZE)
                at = start + b * BLOCK_SIZE
                self.k_cache[blk, :rows] = self.k[at:at + rows]
                self.v_cache[blk, :rows] = self.v[at:at + rows]
            start += n
        self.table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.q_start = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
        self.q_len = torch.tensor(lengths)
        self.out = torch.empty(total, HEADS, HEAD_DIM, dtype=dtype)
        self.flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) / 2 for n in lengths)

    def kernel(self, work: torch.Tensor, cuts: list[int]) -> None:
        cpu_kernels.paged_prefill_attention(self.q, self.k_cache, self.v_cache, self.table,
                                            self.q_start, self.q_len, self.q_len, self.out,
                                            work, cuts)

    def sdpa(self) -> None:
        """The engine's SDPA path for fresh prompts (attention.paged_attention before the
        prefill kernel)."""
        start = 0
        for n in self.lengths:
            o = torch.nn.functional.scaled_dot_product_attention(
                self.q[start:start + n].transpose(0, 1)[None],
                self.k[start:start + n].transpose(0, 1)[None],
                self.v[start:start + n].transpose(0, 1)[None], is_causal=True,
                enable_gqa=True)
            self.out[start:start + n] = o[0].transpose(0, 1)
            start += n


def bench_prefill(dtype: torch.dtype, lengths: list[int], threads: int,
                  rounds: int) -> dict[str, Any]:
    case = Prefill(dtype, lengths, seed=11)
    work, cuts = cpu_kernels.prefill_work(lengths, lengths, KV_HEADS, HEADS // KV_HEADS,
                                          threads)
    case.kernel(work, cuts)
    got = case.out.float().clone()
    case.sdpa()
    result: dict[str, Any] = {"tokens": sum(lengths),
                              "max_abs_diff": float((got - case.out.float()).abs().max())}
    calls = max(1, int(2e8 / case.flops))  # ~10-50 ms a round at these rates
    fns = {"kernel": lambda: [case.kernel(work, cuts) for _ in range(calls)],
           "sdpa": lambda: [case.sdpa() for _ in range(calls)]}
    for name, per_round in time_rounds(fns, rounds).items():
        per_call = [t / calls for t in per_round]
        result[f"{name}_ms_min"] = round(min(per_call) * 1e3, 3)
        result[f"{name}_ms_median"] = round(statistics.median(per_call) * 1e3, 3)
        result[f"{name}_gflops_median"] = round(
            case.flops / statistics.median(per_call) / 1e9, 1)
    result["speedup_median"] = round(result["sdpa_ms_median"] / result["kernel_ms_median"], 2)
    return result


def machine_fields() -> dict[str, Any]:
    """This script's own machine fields, kept beside bench_common.machine()'s."""
    flags = cpu_info()[2]
    return {"cpu": platform.processor() or platform.machine(),
            "avx512": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags}


def main_prefill(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    rounds = args.rounds or (5 if args.quick else 11)
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, lengths in PREFILL_CONFIGS.items():
            key = f"{str(dtype).removeprefix('torch.')}/{name}"
            say(f"{key} ...")
            results[key] = bench_prefill(dtype, lengths, args.threads, rounds)
            say(json.dumps(results[key]))
    report = {
        "benchmark": "attention_bench/prefill",
        "date": date.today().isoformat(),
        "machine": machine(args.threads, **machine_fields(),
                           kernel_path=cpu_kernels.kernel_path()),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE},
        "rounds": rounds,
        "results": results,
    }
    print(json.dumps(report, indent=None if args.json else 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--quick", action="store_true", help="fewer rounds, fewer contexts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=0, help="rounds per config (default 15)")
    ap.add_argument("--pool-mb", type=float, default=192.0,
                    help="KV read by one pass over a configuration's layers")
    ap.add_argument("--portable", action="store_true",
                    help="also time the portable build (and the AVX2 one if not native)")
    ap.add_argument("--storage", nargs="*", default=list(STORAGES), choices=STORAGES)
    ap.add_argument("--contexts", nargs="*", default=list(CONTEXTS), choices=list(CONTEXTS))
    ap.add_argument("--baseline", default=BASELINE_COMMIT,
                    help="the commit whose kernel is 'old' (e.g. HEAD)")
    ap.add_argument("--seqs", type=int, default=SEQS, help="sequences per call")
    ap.add_argument("--q-dtype", choices=("float32", "bfloat16", "cache"), default="float32",
                    help="q/out dtype; 'cache': bfloat16 with a bfloat16 cache, as a bf16 "
                         "model runs, else float32")
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill kernel against SDPA instead (see the module doc)")
    args = ap.parse_args()
    say = progress_log(args.json)
    if args.prefill:
        if not cpu_kernels.available():
            sys.exit("the C kernel could not be compiled here (no C compiler?)")
        torch.set_num_threads(args.threads)
        main_prefill(args, say)
        return
    rounds = args.rounds or (5 if args.quick else 15)
    contexts = args.contexts if not args.quick else ["mixed_300_600", "2048"]
    if not cpu_kernels.available():
        sys.exit("the C kernel could not be compiled here (no C compiler?)")
    old = baseline_module(args.baseline)
    if not old.available():
        sys.exit(f"the baseline kernel ({args.baseline[:7]}) could not be compiled")
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for storage in args.storage:
        for name in contexts:
            lo, hi = CONTEXTS[name]
            rng = random.Random(len(name))
            ctx = [rng.randint(lo, hi) for _ in range(args.seqs)]
            q_dtype = (torch.bfloat16 if args.q_dtype == "bfloat16" or (
                args.q_dtype == "cache" and storage == "bfloat16") else torch.float32)
            say(f"{storage} ctx {name} q {q_dtype} ...")
            results[f"{storage}/ctx_{name}"] = bench_config(
                old, storage, ctx, args.threads, rounds, args.pool_mb, seed=7,
                portable=args.portable, q_dtype=q_dtype)
            results[f"{storage}/ctx_{name}"]["q_dtype"] = str(q_dtype).removeprefix("torch.")
            say(json.dumps(results[f"{storage}/ctx_{name}"]))
    report = {
        "benchmark": "attention_bench",
        "date": date.today().isoformat(),
        "machine": machine(args.threads, **machine_fields(),
                           kernel_vector_width=cpu_kernels.vector_width(),
                           kernel_path=cpu_kernels.kernel_path()),
        "shape": {"seqs": args.seqs, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "new_tokens_per_seq": 1},
        "baseline": args.baseline[:7],
        "rounds": rounds,
        "results": results,
    }
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
