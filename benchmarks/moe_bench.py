"""Mixture-of-experts throughput and latency against transformers, on a random-initialised
Qwen3-MoE of Qwen3-30B-A3B's proportions scaled down to a CPU (CPU; float32 by default,
`--dtype bfloat16` for both).

    .venv/bin/python benchmarks/moe_bench.py --json            # the full run (minutes)
    .venv/bin/python benchmarks/moe_bench.py --quick --json    # a smoke run

The model: Qwen3-30B-A3B has hidden 2048, 48 layers, 32 query / 4 KV heads of 128, 128
experts of width 768 with 8 per token, a 151936-token vocabulary. Here: hidden 1024, 8
layers, 16 / 2 heads of 128, 128 experts of width 192 with 8 per token, a 32000-token
vocabulary: ~0.7B parameters of which ~15% are active per token (~11% without the LM
head). Random weights (transformers' init, seed 0), the same in both engines.

Workload: N requests (64) with random prompts of 64-512 tokens and outputs of 64-256
tokens (EOS ignored), submitted at once. Baseline, in the same process, same weights and
dtype, same thread count: transformers `generate` on static batches of the same requests
(left-padded; each batch runs to its longest output), at each batch size of
`--hf-batch-sizes`; the best counts (`speedup`). transformers runs its default experts
implementation (`grouped_mm`) unless `--hf-experts` says otherwise. Also: single-request
decode speed of both (`single_request_speedup`, the median of three alternated
rounds). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import date

# before torch: idle OpenMP workers sleep, the same for both engines
from bench_common import engine_arg_parser, machine, progress_log  # noqa: I001
# isort: split
import torch
from engine_bench import run_hf_static, run_ridgeline, single_request, workload

#: Qwen3-30B-A3B's shape, narrowed and with fewer layers (see the module doc)
SHAPE = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=2, head_dim=128, num_experts=128, num_experts_per_tok=8,
             moe_intermediate_size=192, intermediate_size=3072, norm_topk_prob=True,
             max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
QUICK_SHAPE = SHAPE | dict(num_hidden_layers=4, num_experts=64, vocab_size=16000)


def build_model(shape: dict, dtype: torch.dtype, experts_impl: str | None):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**shape)
    model = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    if experts_impl:
        model.set_experts_implementation(experts_impl)
    return model


def parameter_counts(shape: dict) -> tuple[int, int]:
    """(total, active per token) parameters, embeddings included in the total, the LM
    head in both (it runs for every token), the input embedding in neither's compute."""
    h, layers, e, k = (shape["hidden_size"], shape["num_hidden_layers"],
                       shape["num_experts"], shape["num_experts_per_tok"])
    q, kv = shape["num_attention_heads"] * shape["head_dim"], \
        shape["num_key_value_heads"] * shape["head_dim"]
    attention = h * (q + 2 * kv) + q * h + 2 * h + 2 * shape["head_dim"]
    expert = 3 * h * shape["moe_intermediate_size"]
    router = e * h
    head = shape["vocab_size"] * h
    total = layers * (attention + router + e * expert) + 2 * head + h
    active = layers * (attention + router + k * expert) + head
    return total, active


def main() -> None:
    ap = engine_arg_parser(__doc__, kv_cache_mb=1024)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--hf-batch-sizes", default=None,
                    help="comma list of transformers' static batch sizes to try "
                         "(default 16,64; --quick: 8)")
    ap.add_argument("--hf-experts", default=None,
                    help="transformers' experts implementation (default: its own, "
                         "grouped_mm)")
    ap.add_argument("--skip", default="", help="comma list: static,single")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both engines' weights and activations")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    log = progress_log(args.json)
    dtype = getattr(torch, args.dtype)

    from ridgeline.engine import LLM

    shape = QUICK_SHAPE if args.quick else SHAPE
    t0 = time.perf_counter()
    hf_model = build_model(shape, dtype, args.hf_experts)
    llm = LLM.from_hf_model(hf_model, num_threads=args.threads,
                            kv_cache_memory_mb=args.kv_cache_mb, max_num_seqs=64,
                            dtype=args.dtype)
    total, active = parameter_counts(shape)
    log(f"model built and loaded in {time.perf_counter() - t0:.0f} s: {total / 1e9:.2f}B "
        f"parameters, {active / 1e6:.0f}M active per token")
    vocab = shape["vocab_size"]
    if args.quick:
        n = args.requests or 12
        reqs = workload(n, (64, 192), (16, 48), vocab, seed=0)
    else:
        n = args.requests or 64
        reqs = workload(n, (64, 512), (64, 256), vocab, seed=0)
    log(f"{n} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
        f"{sum(o for _, o in reqs)} output tokens")

    # warm both up (allocator, first-call overheads): prompts long enough that every
    # expert gets the rows for which ours packs its weights for oneDNN, once per weight
    # (~3 ms each, a load-time cost a server pays once)
    warm = workload(8, (256, 512), (2, 2), vocab, seed=9)
    run_ridgeline(llm, warm)
    run_hf_static(hf_model, warm, 8, 0)

    loads: dict[str, float] = {"start": round(os.getloadavg()[0], 2)}
    result: dict = {"model": "qwen3_moe random, Qwen3-30B-A3B proportions",
                    "shape": shape, "total_params": total, "active_params": active,
                    "active_fraction": round(active / total, 3), "dtype": args.dtype,
                    "threads": args.threads, "requests": n,
                    "prompt_tokens": sum(len(p) for p, _ in reqs),
                    "output_tokens": sum(o for _, o in reqs), "quick": args.quick,
                    "hf_experts_implementation": hf_model.config._experts_implementation,
                    "machine": machine(torch.get_num_threads()),
                    "date": date.today().isoformat(), "torch": torch.__version__}
    ours = run_ridgeline(llm, reqs)
    loads["after_ridgeline"] = round(os.getloadavg()[0], 2)
    log("ridgeline", ours)
    result["ridgeline_output_tok_s"] = round(ours["tok_s"], 2)
    result["ridgeline_seconds"] = round(ours["seconds"], 2)
    result["ridgeline_preemptions"] = ours["preemptions"]

    if "static" not in skip:
        sizes = [int(b) for b in (args.hf_batch_sizes or ("8" if args.quick else "16,64"))
                 .split(",")]
        static = {}
        for bs in sizes:
            static[bs] = run_hf_static(hf_model, reqs, bs, 0)
            loads[f"after_hf_static_{bs}"] = round(os.getloadavg()[0], 2)
            log(f"hf static batch {bs}", static[bs])
        best = max(static, key=lambda bs: static[bs]["tok_s"])
        result["hf_static_tok_s"] = {bs: round(s["tok_s"], 2) for bs, s in static.items()}
        result["hf_output_tok_s"] = round(static[best]["tok_s"], 2)
        result["hf_batch_size"] = best
        result["speedup"] = round(ours["tok_s"] / static[best]["tok_s"], 2)
    if "single" not in skip:
        # alternated, the median of each: other work on a shared machine moves decode
        # speed by 2x within seconds, and a single pair can land on either side of it
        rounds = [single_request(llm, hf_model, reqs[i][0][:128], 32 if args.quick else 96)
                  for i in range(3)]
        single = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        log("single request decode", single)
        result["single_request_tok_s"] = {k: round(v, 2) for k, v in single.items()}
        result["single_request_speedup"] = round(single["ridgeline"] / single["hf"], 2)
    # 1-minute load averages: other work on the machine makes every number slower
    result["load_avg"] = loads
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
