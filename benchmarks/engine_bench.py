"""Engine throughput and latency against transformers, on SmolLM2-135M-Instruct (CPU;
float32 by default, `--dtype bfloat16` for both, `--weight-quant int8` for ours).

    .venv/bin/python benchmarks/engine_bench.py --json            # the full run (~10 min)
    .venv/bin/python benchmarks/engine_bench.py --quick --json    # a smoke run

Workload: N requests (64) with random prompts of 64-512 tokens and outputs of 64-256
tokens (EOS ignored, so every engine produces exactly the same number of tokens),
submitted at once. Baselines, in the same process, same weights, same thread count:

- transformers `generate` on static batches of the same requests (left-padded; each batch
  runs to its longest output); batch size `--hf-batch-size`;
- transformers' continuous batching (the paged `ContinuousBatchingManager` behind
  `generate_batch`, with per-request `max_new_tokens`), with an explicit KV pool of the same
  size as ours.

Also: single-request decode speed of both engines, time to first token of a request
whose 512-token prefix is cached versus one whose prefix is not, and the fraction of the
matmul-only floor reached (the time the engine's own matmuls need for the forward passes
it ran, measured on its weights right before and right after the run, the mean of the two,
over its wall time; `fraction_of_matmul_floor_range` gives each alone), and of the floor that
adds the KV reads of its attention (every cached K/V byte read once per pass at the
measured memory bandwidth). Prints one JSON object.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import statistics
import time
from datetime import date

# before torch: idle OpenMP workers sleep, the same for both engines
from bench_common import (
    engine_arg_parser,
    machine,
    median_seconds,
    progress_log,
    read_bandwidth_gbs,  # noqa: I001
)
# isort: split
import torch


def workload(n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
             seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(([rng.randrange(100, vocab) for _ in range(plen)], rng.randint(*out_range)))
    return reqs


def run_ridgeline(llm, reqs) -> dict:
    from ridgeline.engine import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(n for _, n in reqs)
    return {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed,
            "preemptions": llm.engine.num_preemptions}


class ForwardLog:
    """Records (tokens in the pass, logit rows) of every forward the engine runs: what
    the matmul-only floor is computed from; and the cached tokens each pass's attention
    reads (the context of every sequence that had some before the pass): the KV floor."""

    def __init__(self, runner) -> None:
        self.passes: list[tuple[int, int]] = []
        self.kv_tokens_read = 0
        self._runner = runner
        self._execute = runner.execute

        def execute(scheduled, lookahead=None):
            self.kv_tokens_read += sum(seq.num_computed_tokens + n for seq, n in scheduled
                                       if seq.num_computed_tokens > 0)
            out = self._execute(scheduled, lookahead)
            rows = 0 if out.logits is None else int(out.logits.shape[0])
            self.passes.append((out.num_tokens, rows))
            return out

        runner.execute = execute

    def close(self) -> None:
        self._runner.execute = self._execute


GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


@torch.inference_mode()
def matmul_speeds(engine) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds the engine's own matmuls take at each row count of GRID: every projection
    of every layer (its own weights, so they stream from memory as in a real pass), and
    the LM head, through its own Linear modules and LM head (float or int8)."""
    from ridgeline.engine.model_executor.models.layers import int8_linear, linear

    model = engine.runner.model
    projections = [m for layer in model.layers for m in (
        layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    hidden = model.cfg.hidden_size
    head = model.embed if model.lm_head is None else model.lm_head

    def project(p, x: torch.Tensor) -> torch.Tensor:  # Linear.forward, no module call
        if p.qweight is not None:
            return int8_linear(x, p.qweight, p.scales, p.bias)
        return linear(x, p.weight, p.bias)

    def head_product(x: torch.Tensor) -> torch.Tensor:  # compute_logits without .float()
        if model.quantized:
            return int8_linear(x, model.head_q, model.head_scales)
        return linear(x, head)

    layer_s, head_s = {}, {}
    for m in GRID:
        xs = {p.in_features: torch.randn(m, p.in_features, dtype=model.dtype)
              for p in projections}
        layer_s[m] = median_seconds(
            lambda: [project(p, xs[p.in_features]) for p in projections], min_s=0.0, reps=3)
        xh = torch.randn(m, hidden, dtype=model.dtype)
        head_s[m] = median_seconds(lambda: head_product(xh), min_s=0.0, reps=3)
    return layer_s, head_s


def matmul_floor(speeds: tuple[dict[int, float], dict[int, float]],
                 passes: list[tuple[int, int]]) -> float:
    """Seconds the matmuls of `passes` need (every projection of every layer at the pass's
    token count, the LM head at its logit rows) at `speeds` (matmul_speeds), interpolated
    between the grid's row counts: a floor no schedule of these passes goes below."""
    layer_s, head_s = speeds

    def at(table: dict[int, float], m: int) -> float:
        if m <= 0:
            return 0.0
        lo = max([g for g in GRID if g <= m], default=GRID[0])
        hi = min([g for g in GRID if g >= m], default=GRID[-1])
        if hi == lo:
            return table[lo] * (m / lo if m > GRID[-1] else 1.0)
        f = (m - lo) / (hi - lo)
        return table[lo] + f * (table[hi] - table[lo])

    return sum(at(layer_s, t) + at(head_s, r) for t, r in passes)


def run_hf_static(model, reqs, batch_size: int, pad_id: int) -> dict:
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        longest = max(n for _, n in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                             min_new_tokens=longest, do_sample=False, eos_token_id=None,
                             pad_token_id=pad_id)
        assert out.shape[1] == width + longest
        tokens += sum(n for _, n in batch)  # only what each request asked for counts
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed,
            "batch_size": batch_size}


def run_hf_cb(model, reqs, num_blocks: int, page_size: int, max_batch_tokens: int) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs),
                           eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size,
                                  max_batch_tokens=max_batch_tokens)
    start = time.perf_counter()
    done: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True,
            timeout=5) as manager:
        for i, (p, n) in enumerate(reqs):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        while len(done) < len(reqs):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result.generated_tokens
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    elapsed = time.perf_counter() - start
    tokens = sum(len(t) for t in done.values())
    assert tokens == sum(n for _, n in reqs), (tokens, sum(n for _, n in reqs))
    return {"seconds": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed,
            "num_blocks": num_blocks, "page_size": page_size}


def single_request(llm, model, prompt: list[int], n: int) -> dict:
    """Decode speed of one request (tokens after the first / time after the first)."""
    from ridgeline.engine import SamplingParams

    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                ignore_eos=True))[0]
    m = out.metrics
    ours = (n - 1) / (m.finished_time - m.first_token_time)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        t2 = time.perf_counter()
    hf = (n - 1) / ((t2 - t1) - (t1 - t0))
    return {"ridgeline": ours, "hf": hf}


def llama_cpp_decode(args, engine, depth: int) -> dict[str, float]:
    """llama.cpp's decode on the model's GGUF file as shipped and requantized to the
    numbers we run (llama_cpp_baseline.py), same thread count, same context depth."""
    from llama_cpp_baseline import single_request as llama_single

    from ridgeline.engine.model_executor.registry import resolve_model

    entry = resolve_model(args.model)
    if entry.format != "gguf":
        raise SystemExit("--llama-cpp needs a GGUF model")
    settings = [args.dtype] + (["int8"] if args.weight_quant == "int8" else [])
    tok_s = llama_single(args.llama_cpp, entry.path, settings, threads=args.threads,
                         depth=depth, n=32 if args.quick else 128)
    return {f"llama_cpp_{t}": v for t, v in tok_s.items()}


def ttft(llm, vocab: int, prefix_len: int, repeats: int = 3) -> tuple[float, float]:
    """Median time to first token (ms) of a prompt = prefix + 16 new tokens, with the prefix
    cached by an earlier request versus never seen."""
    from ridgeline.engine import SamplingParams

    rng = random.Random(1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cached, uncached = [], []
    for _ in range(repeats):
        prefix = [rng.randrange(100, vocab) for _ in range(prefix_len)]
        tail = [[rng.randrange(100, vocab) for _ in range(16)] for _ in range(2)]
        cold = llm.generate([prefix + tail[0]], one)[0]
        warm = llm.generate([prefix + tail[1]], one)[0]
        assert warm.metrics.num_cached_tokens >= prefix_len - llm.engine.config.block_size
        uncached.append(cold.metrics.ttft * 1000)
        cached.append(warm.metrics.ttft * 1000)
    return statistics.median(cached), statistics.median(uncached)


def main() -> None:
    ap = engine_arg_parser(__doc__, kv_cache_mb=1536)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--hf-batch-size", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma list: static,cb,single,ttft")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both engines' weights and activations")
    ap.add_argument("--weight-quant", choices=["none", "int8"], default="none",
                    help="ours only: weight-only int8 (transformers stays in --dtype)")
    ap.add_argument("--llama-cpp", metavar="DIR", default=None,
                    help="folder with llama.cpp's llama-bench and llama-quantize: adds its "
                         "single-request decode on the same weights (GGUF models only)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(args.threads)
    log = progress_log(args.json)

    from ridgeline.engine import LLM

    overrides = {"num_threads": args.threads, "kv_cache_memory_mb": args.kv_cache_mb,
                 "max_num_seqs": 64, "dtype": args.dtype, "weight_quant": args.weight_quant}
    if args.max_num_batched_tokens:
        overrides["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(args.model, **overrides)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    if args.quick:
        n = args.requests or 12
        reqs = workload(n, (64, 192), (16, 48), vocab, seed=0)
    else:
        n = args.requests or 64
        reqs = workload(n, (64, 512), (64, 256), vocab, seed=0)
    log(f"{n} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
        f"{sum(o for _, o in reqs)} output tokens")

    # the same weights in transformers (the HF directory the GGUF file was converted to)
    from transformers import AutoModelForCausalLM

    source_dir = getattr(engine.source, "path", None)
    hf_model = AutoModelForCausalLM.from_pretrained(
        source_dir, dtype=getattr(torch, args.dtype)).eval()
    pad_id = engine.tokenizer.pad_token_id or 0

    # warm both up (allocator, first-call overheads)
    warm = workload(2, (32, 64), (4, 4), vocab, seed=9)
    run_ridgeline(llm, warm)
    run_hf_static(hf_model, warm, 2, pad_id)

    loads: dict[str, float] = {"start": round(os.getloadavg()[0], 2)}
    result: dict = {"model": args.model, "dtype": args.dtype,
                    "weight_quant": args.weight_quant, "threads": args.threads,
                    "requests": n, "prompt_tokens": sum(len(p) for p, _ in reqs),
                    "output_tokens": sum(o for _, o in reqs), "quick": args.quick,
                    "machine": machine(torch.get_num_threads()),
                    "date": date.today().isoformat(), "torch": torch.__version__}
    # the matmuls' speed right before and right after the run: the VM's speed moves by
    # 10-20% within minutes, and a floor measured only after the run gave fractions of
    # 0.57-0.75 over three bf16 runs of one session; the mean of the two is the run's
    # floor, each alone gives the fraction's range
    before = matmul_speeds(engine)
    forwards = ForwardLog(engine.runner)
    ours = run_ridgeline(llm, reqs)
    forwards.close()
    loads["after_ridgeline"] = round(os.getloadavg()[0], 2)
    after = matmul_speeds(engine)
    floors = [matmul_floor(speeds, forwards.passes) for speeds in (before, after)]
    floor = sum(floors) / 2
    result["matmul_floor_seconds"] = round(floor, 2)
    result["matmul_floor_seconds_before_after"] = [round(f, 2) for f in floors]
    result["fraction_of_matmul_floor"] = round(floor / ours["seconds"], 3)
    result["fraction_of_matmul_floor_range"] = [round(min(floors) / ours["seconds"], 3),
                                                round(max(floors) / ours["seconds"], 3)]
    # attention must read every cached K/V byte once per pass: at the measured memory
    # bandwidth that is a floor of its own, beside the matmuls'
    bandwidth = read_bandwidth_gbs()
    kv_floor = forwards.kv_tokens_read * engine.kv_bytes_per_token / bandwidth / 1e9
    result["read_bandwidth_gbs"] = bandwidth
    result["kv_read_floor_seconds"] = round(kv_floor, 2)
    result["fraction_of_matmul_and_kv_floor"] = round((floor + kv_floor) / ours["seconds"], 3)
    result["forward_passes"] = len(forwards.passes)
    log("ridgeline", ours)
    result["ridgeline_output_tok_s"] = round(ours["tok_s"], 2)
    result["ridgeline_seconds"] = round(ours["seconds"], 2)
    result["ridgeline_preemptions"] = ours["preemptions"]
    stats = engine.stats()
    result["kv_bytes_per_token"] = stats.kv_bytes_per_token
    result["kv_blocks"] = stats.num_blocks

    if "static" not in skip:
        # measured on the full workload: 16 -> 34.4, 32 -> 43.5, 64 -> 44.1 tok/s
        bs = args.hf_batch_size or (8 if args.quick else 64)
        static = run_hf_static(hf_model, reqs, bs, pad_id)
        loads["after_hf_static"] = round(os.getloadavg()[0], 2)
        log("hf static", static)
        result["hf_output_tok_s"] = round(static["tok_s"], 2)
        result["hf_seconds"] = round(static["seconds"], 2)
        result["hf_batch_size"] = bs
        result["speedup"] = round(ours["tok_s"] / static["tok_s"], 2)
    if "cb" not in skip:
        page = 256
        blocks = max(int(args.kv_cache_mb * 2**20 // (page * engine.kv_bytes_per_token)), 8)
        with contextlib.redirect_stdout(io.StringIO()):
            cb = run_hf_cb(hf_model, reqs, blocks, page,
                           engine.scheduler.max_num_batched_tokens)
        loads["after_hf_cb"] = round(os.getloadavg()[0], 2)
        log("hf continuous batching", cb)
        result["hf_cb_output_tok_s"] = round(cb["tok_s"], 2)
        result["hf_cb_seconds"] = round(cb["seconds"], 2)
        result["hf_cb_num_blocks"] = blocks
        result["hf_cb_page_size"] = page
        result["speedup_vs_hf_cb"] = round(ours["tok_s"] / cb["tok_s"], 2)
    if "single" not in skip:
        single = single_request(llm, hf_model, reqs[0][0][:128], 32 if args.quick else 128)
        log("single request decode", single)
        if args.llama_cpp:
            single.update(llama_cpp_decode(args, engine, 128))
        result["single_request_tok_s"] = {k: round(v, 2) for k, v in single.items()}
    if "ttft" not in skip:
        cached, uncached = ttft(llm, vocab, 512)
        log("ttft cached / uncached ms", cached, uncached)
        result["ttft_cached_prefix_ms"] = round(cached, 1)
        result["ttft_uncached_ms"] = round(uncached, 1)
        result["ttft_ratio"] = round(uncached / cached, 1)
    # 1-minute load averages: other work on the machine makes every number slower
    result["load_avg"] = loads
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
