"""How much a quantized KV cache changes SmolLM2-135M-Instruct's greedy output, and what it
buys in capacity.

    .venv/bin/python benchmarks/kv_quant_bench.py --json           # 32 prompts x 64 tokens
    .venv/bin/python benchmarks/kv_quant_bench.py --quick --json   # 8 prompts x 32 tokens

For each cache dtype (bfloat16 for reference, int8, fp8) against the full-precision
(float32) cache, same weights, same batch of prompts:

- `greedy_token_agreement`: free-running greedy continuations compared position by
  position (after a first difference the rest usually differs too, so this is strict);
- `identical_continuations`: prompts whose whole continuation is unchanged;
- `teacher_forced_agreement`: the float32 continuation is fed to both caches and each
  position's argmax compared (every position counts once, divergences do not compound);
- bytes per token and tokens that fit the same memory budget;
- a control: the float32 cache with each prompt run alone instead of in one batch (only
  the matmul shapes, hence rounding, change), to show how much free-running agreement
  moves with no quantization at all.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import date
from typing import Any

# before torch: idle OpenMP workers sleep, the same for every cache
from bench_common import engine_arg_parser, machine, on_worker_thread, progress_log  # noqa: I001

import torch  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.",
    "Give three tips for better sleep.", "What is a prime number?",
    "How do airplanes stay in the air?", "Write a haiku about the sea.",
    "What causes the seasons on Earth?", "Describe a cat to someone who has never seen one.",
    "Why do we need to drink water?", "What is the difference between a virus and a bacterium?",
    "Suggest a name for a coffee shop.", "How does a refrigerator work?",
    "What is machine learning?", "List some healthy breakfast ideas.",
    "Why is exercise important?", "What are the planets of the solar system?",
]
CODE = [
    "Write a Python function that reverses a string.",
    "Write a Python function to check whether a number is even.",
    "How do I read a file line by line in Python?",
    "Write a SQL query that counts the rows of a table named users.",
    "Write a bash command that lists all .txt files in a directory.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a function that returns the maximum of a list in Python.",
    "What does the git status command do?",
]
TEXT = [
    "Once upon a time, in a small village by the mountains,",
    "The history of the printing press begins",
    "To make a good cup of tea, first",
    "The main reasons people learn a second language are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In the morning, the market was already busy:",
    "The three laws of motion formulated by Newton are",
    "import json\n\n\ndef load(path):\n",
]


def prompt_ids(tok: Any, n: int) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS + CODE]
    ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)) for c in chats]
    ids += [tok(t)["input_ids"] for t in TEXT]
    # interleave the kinds so --quick keeps some of each
    order = sorted(range(len(ids)), key=lambda i: (i % 4, i))
    return [ids[i] for i in order][:n]


def generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from ridgeline.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", prompt_token_ids=p, params=params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"g{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def teacher_forced_argmax(engine: Any, prompt: list[int], forced: list[int]) -> list[int]:
    """Argmax after each prefix of `forced`, with all of it attending through the cache."""
    from ridgeline.engine import SamplingParams
    from ridgeline.engine.sequence import Sequence

    seq = Sequence("tf", 0, list(prompt), len(prompt), SamplingParams())
    bm = engine.block_manager
    assert bm.allocate_slots(seq, len(prompt) + len(forced))
    try:
        engine.runner.forward([(seq.block_table, 0, prompt[:-1], 0)])
        logits = engine.runner.forward([(seq.block_table, len(prompt) - 1,
                                         [prompt[-1]] + forced[:-1], len(forced))])
        return logits.argmax(-1).tolist()
    finally:
        bm.free_seq(seq)


def main() -> None:
    ap = engine_arg_parser(__doc__, kv_cache_mb=256, quick_help="8 prompts x 32 tokens")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    args = ap.parse_args()
    result = on_worker_thread(lambda: bench(args), "kv-quant-bench")
    print(json.dumps(result, indent=None if args.json else 2))


def bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    from ridgeline.engine import EngineConfig, LLMEngine

    log = progress_log(args.json)
    n = args.prompts or (8 if args.quick else 32)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    base = EngineConfig.build(model=args.model, num_threads=args.threads,
                              kv_cache_memory_mb=args.kv_cache_mb, max_num_seqs=n)
    ref_engine = LLMEngine(base)
    prompts = prompt_ids(ref_engine.tokenizer, n)
    start = time.perf_counter()
    ref = generate(ref_engine, prompts, max_tokens)
    ref_tf = [teacher_forced_argmax(ref_engine, p, r) for p, r in zip(prompts, ref)]
    log(f"float32: {time.perf_counter() - start:.0f} s")
    ref_stats = ref_engine.stats()
    out: dict[str, Any] = {
        "model": args.model, "prompts": n, "tokens_per_prompt": max_tokens,
        "kv_cache_memory_mb": args.kv_cache_mb,
        "float32_kv_bytes_per_token": ref_stats.kv_bytes_per_token,
        "float32_kv_capacity_tokens": ref_stats.kv_capacity_tokens,
        "float32_teacher_forced_self_agreement": round(
            sum(a == b for x, y in zip(ref_tf, ref) for a, b in zip(x, y)) / (n * max_tokens), 4),
        "machine": machine(args.threads, cpu=platform.processor() or platform.machine()),
        "date": date.today().isoformat(), "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_avg_start": round(os.getloadavg()[0], 2),
    }
    # control: the same float32 cache, each prompt alone (other matmul shapes, so other
    # rounding): how far greedy continuations move with no quantization at all
    start = time.perf_counter()
    alone = [generate(ref_engine, [p], max_tokens)[0] for p in prompts]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
              for x, y in zip(ref, alone)]
    out["float32_unbatched_control"] = {
        "greedy_token_agreement": round(
            sum(a == b for x, y in zip(ref, alone) for a, b in zip(x, y)) / (n * max_tokens), 4),
        "identical_continuations": f"{sum(f is None for f in firsts)}/{n}"}
    log("float32 one prompt at a time", out["float32_unbatched_control"],
        f"{time.perf_counter() - start:.0f} s")
    del ref_engine
    for kind in ("bfloat16", "int8", "fp8"):
        start = time.perf_counter()
        engine = LLMEngine(base.model_copy(update={"kv_cache_dtype": kind}))
        got = generate(engine, prompts, max_tokens)
        tf = [teacher_forced_argmax(engine, p, r) for p, r in zip(prompts, ref)]
        stats = engine.stats()
        same = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                 for x, y in zip(ref, got)]
        out[kind] = {
            "greedy_token_agreement": round(same / (n * max_tokens), 4),
            "identical_continuations": f"{sum(f is None for f in first)}/{n}",
            "first_divergence_positions": sorted(f for f in first if f is not None),
            "teacher_forced_agreement": round(
                sum(a == b for x, y in zip(ref_tf, tf) for a, b in zip(x, y))
                / (n * max_tokens), 4),
            "kv_bytes_per_token": stats.kv_bytes_per_token,
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "capacity_ratio": round(stats.kv_capacity_tokens / out["float32_kv_capacity_tokens"],
                                    2),
        }
        log(kind, out[kind], f"{time.perf_counter() - start:.0f} s")
        del engine
    out["goal_met_int8"] = out["int8"]["greedy_token_agreement"] >= 0.99
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    return out


if __name__ == "__main__":
    main()
