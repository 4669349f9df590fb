"""Speed of the high-speed variants (`<model>:fast`: speculative decoding from n-grams and,
where `ridgeline train-draft-heads` trained them, the model's draft heads, lossless;
`<model>:fast-q`: the same plus int8 KV cache and int8 weights) against the standard
one, on SmolLM2-135M-Instruct, one request at a time. With draft heads, `fast_ngram` (the
fast variant on n-grams alone) runs beside them, showing what the heads add.

    .venv/bin/python benchmarks/spec_bench.py --json            # the full run (~10 min)
    .venv/bin/python benchmarks/spec_bench.py --quick --json    # a smoke run
    .venv/bin/python benchmarks/spec_bench.py --replay --json   # proposers offline (~3 min)

Workloads (chat-templated, greedy, up to --max-tokens new tokens, EOS ends a reply):
- repetitive: code edits ("here is a file, rewrite it with one change") and agent traces
  (a log of tool calls the model is asked to repeat with a change): output that copies
  its context, where prompt lookup shines;
- chat: plain questions, where proposals come only from the reply repeating itself.

Engines, built from the same EngineConfig in the same process: `standard`,
`fast` (= `EngineConfig.fast_variant()`, whose greedy output must equal the standard one
token for token) and `fast_q` (= `fast_q_variant()`, whose int8 cache and weights may
flip near-ties: its token agreement is reported). Prompts alternate between the
engines so that load on this shared machine hits both alike, and all engines run on one
worker thread (torch matmuls issued from the main thread have been measured much slower
here). Output speed is tokens per second after the first token (as "output speed" is
usually quoted); end-to-end numbers include prefill.

Load-independent numbers, per workload, for the speculating engines: tokens per forward
pass (output tokens / passes, the prefill pass included; standard: 1.0), rejected
proposals per output token (verification work wasted) and the acceptance rate.

`--replay`: decode each prompt once with the standard engine (or read those outputs from
`--replay-cache`, written there otherwise), then replay the n-gram proposers on them
(`speculative.replay_greedy`: exact for greedy, milliseconds per request) at fixed step
costs `a + b * tokens` with b/a in `--cost-ratios` (0.4: about this CPU; near 0: a verify
pass costs what a one-token step does), for `ngram_mode` "lookup" (the most recent
occurrence, k from recent acceptance) and "suffix" (the default). Reports the same
per-workload numbers, a modelled speed-up (output tokens per unit of step cost against
plain decoding's a + b per token) and the proposer's microseconds per call at 2k and 8k
tokens of context.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from datetime import date
from typing import Any

# before torch: idle OpenMP workers sleep (a spinning one that loses its core stalled
# 2..8-token forward passes by a scheduler slice here, which would hide what speculation
# does); the same for both sides
from bench_common import engine_arg_parser, machine, on_worker_thread, progress_log  # noqa: I001
# isort: split
import torch

FILES = {
    "config.py": '''import os
from dataclasses import dataclass, field


@dataclass
class DatabaseConfig:
    host: str = "localhost"
    port: int = 5432
    user: str = "app"
    password: str = ""
    name: str = "app"

    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{self.name}"


@dataclass
class AppConfig:
    debug: bool = False
    workers: int = 4
    database: DatabaseConfig = field(default_factory=DatabaseConfig)


def load_config() -> AppConfig:
    config = AppConfig()
    config.debug = os.environ.get("APP_DEBUG", "0") == "1"
    config.workers = int(os.environ.get("APP_WORKERS", "4"))
    config.database.host = os.environ.get("DB_HOST", "localhost")
    config.database.port = int(os.environ.get("DB_PORT", "5432"))
    return config
''',
    "users.py": '''def load_users(db, limit=10):
    rows = db.execute("SELECT id, name, email FROM users LIMIT ?", (limit,))
    return [dict(id=r[0], name=r[1], email=r[2]) for r in rows]


def find_user(db, user_id):
    rows = db.execute("SELECT id, name, email FROM users WHERE id = ?", (user_id,))
    for r in rows:
        return dict(id=r[0], name=r[1], email=r[2])
    return None


def delete_user(db, user_id):
    db.execute("DELETE FROM users WHERE id = ?", (user_id,))
    db.commit()


def count_users(db):
    rows = db.execute("SELECT COUNT(*) FROM users")
    return rows[0][0]
''',
    "stack.py": '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        if not self.items:
            raise IndexError("peek at an empty stack")
        return self.items[-1]

    def is_empty(self):
        return len(self.items) == 0

    def size(self):
        return len(self.items)
''',
    "retry.py": '''import time


def retry(func, attempts=3, delay=1.0):
    last_error = None
    for attempt in range(attempts):
        try:
            return func()
        except Exception as error:
            last_error = error
            time.sleep(delay)
    raise last_error


def fetch(url, session, attempts=3):
    def get():
        response = session.get(url, timeout=10)
        response.raise_for_status()
        return response.json()
    return retry(get, attempts=attempts)
''',
}
EDITS = {
    "config.py": "change the default number of workers from 4 to 8",
    "users.py": "rename the function load_users to fetch_users",
    "stack.py": "rename the method peek to top",
    "retry.py": "change the default delay from 1.0 to 0.5 seconds",
}
TRACES = [
    ("$ ls src\napp.py  models.py  utils.py\n$ grep -n \"def \" src/app.py\n3:def main():\n"
     "12:def parse_args():\n27:def run(config):\n$ python -m pytest tests -q\n"
     "....F.\nFAILED tests/test_app.py::test_run - AssertionError: expected 3, got 2\n"
     "$ sed -n 27,40p src/app.py\ndef run(config):\n    total = 0\n    for item in "
     "config.items:\n        total += 1\n    return total - 1\n",
     "Repeat exactly the same sequence of commands, each on its own line starting with $, "
     "but run pytest with -x instead of -q."),
    ("Step 1: read_file(path=\"README.md\") -> 42 lines\nStep 2: read_file(path=\"setup.py\")"
     " -> 30 lines\nStep 3: run(cmd=\"pip install -e .\") -> ok\nStep 4: run(cmd=\"pytest\") "
     "-> 2 failed, 10 passed\nStep 5: read_file(path=\"tests/test_io.py\") -> 88 lines\n"
     "Step 6: edit_file(path=\"src/io.py\", line=14) -> ok\nStep 7: run(cmd=\"pytest\") -> "
     "12 passed\n",
     "Write the same list of steps again, numbered the same way, but with the file "
     "src/io.py replaced by src/reader.py everywhere."),
]
CHAT = [
    "What are three good habits for staying healthy?",
    "Explain what a hash table is to a beginner.",
    "Write a short story about a robot who learns to paint.",
    "What is the difference between weather and climate?",
    "Give me some tips for learning a new language.",
    "Why is the sky blue?",
]


def prompts(quick: bool) -> dict[str, list[list[dict[str, str]]]]:
    edits = [[{"role": "user", "content": f"Here is the file {name}:\n\n```python\n{src}```\n\n"
                                          f"Rewrite the whole file with one change: "
                                          f"{EDITS[name]}. Output only the code."}]
             for name, src in FILES.items()]
    traces = [[{"role": "user", "content": f"Here is a log of an agent's actions:\n\n{log}\n"
                                           f"{ask}"}] for log, ask in TRACES]
    chat = [[{"role": "user", "content": c}] for c in CHAT]
    if quick:
        return {"repetitive": edits[:1] + traces[:1], "chat": chat[:2]}
    return {"repetitive": edits + traces, "chat": chat}


def run_one(engine: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    from ridgeline.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rid = f"r{time.monotonic_ns()}"
    before = engine.stats()
    start = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=ids, params=params)
    first = None
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            final = out
    end = time.perf_counter()
    tokens = list(final.outputs[0].token_ids)
    after = engine.stats()
    return {"tokens": tokens, "seconds": end - start, "decode_seconds": end - (first or end),
            # one request at a time: every step is one forward pass of this request
            "passes": after.num_steps - before.num_steps,
            "proposed": (after.spec_proposed_tokens or 0) - (before.spec_proposed_tokens or 0),
            "accepted": (after.spec_accepted_tokens or 0) - (before.spec_accepted_tokens or 0)}


def main() -> None:
    ap = engine_arg_parser(__doc__, kv_cache_mb=256)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="standard and fast variants' dtype (fast-q is always bfloat16)")
    ap.add_argument("--train-heads", action="store_true",
                    help="train the model's draft heads first if it has none (~8 min)")
    ap.add_argument("--replay", action="store_true",
                    help="replay the n-gram proposers on the standard engine's outputs")
    ap.add_argument("--replay-cache", default=None,
                    help="JSON file of the standard outputs for --replay (read if present)")
    ap.add_argument("--cost-ratios", default="0.4,0.1,0.02",
                    help="--replay: b/a of the step cost a + b * tokens, comma-separated")
    args = ap.parse_args()
    log = progress_log(args.json)
    max_tokens = args.max_tokens or (64 if args.quick else 160)
    work = replay if args.replay else bench
    result = on_worker_thread(lambda: work(args, max_tokens, log), "spec-bench")
    print(json.dumps(result, indent=None if args.json else 2))


def base_config(args: argparse.Namespace) -> Any:
    from ridgeline.engine import EngineConfig

    return EngineConfig.build(model=args.model, num_threads=args.threads,
                              kv_cache_memory_mb=args.kv_cache_mb, max_num_seqs=8,
                              dtype=args.dtype)


def tokenized(tok: Any, quick: bool) -> dict[str, list[list[int]]]:
    return {kind: [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)) for m in msgs]
            for kind, msgs in prompts(quick).items()}


def pass_stats(passes: int, emitted: int, proposed: int, accepted: int) -> dict[str, Any]:
    """The load-independent numbers of one workload."""
    return {"tokens_per_pass": round(emitted / passes, 3) if passes else None,
            "rejected_per_token": round((proposed - accepted) / emitted, 3) if emitted else None,
            "acceptance": round(accepted / proposed, 3) if proposed else None}


def bench(args: argparse.Namespace, max_tokens: int, log: Any) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    from ridgeline.engine import LLMEngine

    base = base_config(args)
    standard = LLMEngine(base)
    out: dict[str, Any] = {}
    if args.train_heads:  # before the fast engines, which load the heads
        out["draft_heads_training_s"] = train_heads_if_missing(standard, log)
    fast_cfg = base.fast_variant()
    fast_q_cfg = base.fast_q_variant()
    engines = {"standard": standard, "fast": LLMEngine(fast_cfg),
               "fast_q": LLMEngine(fast_q_cfg)}
    heads = getattr(engines["fast"].speculator.proposer, "heads", None)
    if heads is not None:  # what the heads add: the same variant on n-grams alone
        spec = fast_cfg.speculative.model_copy(update={"draft_heads": None})
        engines["fast_ngram"] = LLMEngine(fast_cfg.model_copy(update={"speculative": spec}))
    else:
        log("no draft heads trained for this model: `fast` speculates from n-grams only "
            "(ridgeline train-draft-heads trains them, ~8 min)")
    work = tokenized(engines["standard"].tokenizer, args.quick)
    for engine in engines.values():  # first-call overheads
        run_one(engine, work["chat"][0][:8], 4)

    load_start = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {e: [] for e in engines} for k in work}
    order = list(engines)
    for kind, items in work.items():
        for i, ids in enumerate(items):
            # alternate which engine goes first, so drifting load hits all alike
            for name in order[i % len(order):] + order[:i % len(order)]:
                r = run_one(engines[name], ids, max_tokens)
                runs[kind][name].append(r)
                log(f"{kind}[{i}] {name}: {len(r['tokens'])} tokens, "
                    f"{len(r['tokens']) / r['seconds']:.1f} tok/s end to end")

    out |= {
        "model": args.model, "threads": args.threads, "quick": args.quick,
        "max_tokens": max_tokens, "dtype": base.dtype,
        "fast_config": {"speculative": fast_cfg.speculative.model_dump(),
                        "kv_cache_dtype": fast_cfg.kv_cache_dtype},
        "fast_q_config": {"kv_cache_dtype": fast_q_cfg.kv_cache_dtype,
                          "weight_quant": fast_q_cfg.weight_quant},
        "machine": machine(args.threads),
        "date": date.today().isoformat(), "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    identical = {name: True for name in engines if name != "standard"}
    agree = total = 0
    for kind, by_engine in runs.items():
        std = by_engine["standard"]
        for name in engines:
            rs = by_engine[name]
            toks = sum(len(r["tokens"]) - 1 for r in rs)
            dec = sum(r["decode_seconds"] for r in rs)
            e2e_toks = sum(len(r["tokens"]) for r in rs)
            out[f"{name}_{kind}_output_tok_s"] = round(toks / dec, 2) if dec else None
            out[f"{name}_{kind}_e2e_tok_s"] = round(e2e_toks / sum(r["seconds"] for r in rs), 2)
            out[f"{name}_{kind}_output_tokens"] = e2e_toks
            if name != "standard":
                for key, val in pass_stats(sum(r["passes"] for r in rs), e2e_toks,
                                           sum(r["proposed"] for r in rs),
                                           sum(r["accepted"] for r in rs)).items():
                    out[f"{name}_{kind}_{key}"] = val
        for name in identical:
            same = [a["tokens"] == b["tokens"] for a, b in zip(std, by_engine[name])]
            identical[name] = identical[name] and all(same)
            out[f"{name}_{kind}_identical_outputs"] = f"{sum(same)}/{len(same)}"
        for a, b in zip(std, by_engine["fast_q"]):
            agree += sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
            total += max(len(a["tokens"]), len(b["tokens"]))
        for name, key in (("fast", "speedup"), ("fast_q", "fast_q_speedup"),
                          ("fast_ngram", "fast_ngram_speedup")):
            if name not in engines:
                continue
            s, f = out[f"standard_{kind}_output_tok_s"], out[f"{name}_{kind}_output_tok_s"]
            out[f"{key}_{kind}"] = round(f / s, 2) if s and f else None
            out[f"{key}_{kind}_e2e"] = round(out[f"{name}_{kind}_e2e_tok_s"]
                                             / out[f"standard_{kind}_e2e_tok_s"], 2)
    fast_stats = engines["fast"].stats()
    out["acceptance_rate"] = (round(fast_stats.spec_acceptance_rate, 3)
                              if fast_stats.spec_acceptance_rate is not None else None)
    out["proposed_tokens"] = fast_stats.spec_proposed_tokens
    out["accepted_tokens"] = fast_stats.spec_accepted_tokens
    a, b = engines["fast"].speculator.cost.coefficients()
    out["fast_step_cost_ms"] = {"a": round(a * 1e3, 2), "b_per_token": round(b * 1e3, 2)}
    out["greedy_identical"] = identical["fast"]
    out["fast_draft_heads"] = None if heads is None else {
        "fingerprint": heads.fingerprint, "num_heads": heads.num_heads,
        "vocab": len(heads.vocab_ids),
        "head_proposals": engines["fast"].speculator.proposer.num_head_proposals}
    out["greedy_identical_fast_q"] = identical["fast_q"]
    out["fast_q_vs_standard_token_agreement"] = round(agree / total, 4) if total else None
    for name in ("standard", "fast_q"):
        s = engines[name].stats()
        out[f"{name}_kv_bytes_per_token"] = s.kv_bytes_per_token
        out[f"{name}_kv_capacity_tokens"] = s.kv_capacity_tokens
    out["load_avg"] = {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)}
    return out


def train_heads_if_missing(standard: Any, log: Any) -> float | None:
    """Seconds spent training the draft heads of `standard`'s model (None: it had them);
    the replies come from a bfloat16 engine, as `ridgeline train-draft-heads` makes them."""
    from ridgeline.engine import LLMEngine
    from ridgeline.engine.draft_training import train_and_store
    from ridgeline.engine.spec_decode.draft_heads import heads_cache_path, model_fingerprint

    cfg = standard.config
    if heads_cache_path(model_fingerprint(standard.model), cfg.cache_dir).is_file():
        return None
    start = time.perf_counter()
    engine = LLMEngine(cfg.model_copy(update={"dtype": "bfloat16", "max_num_seqs": 64}))
    log(f"training draft heads: {train_and_store(engine, progress=log)}")
    return round(time.perf_counter() - start, 1)


def replay(args: argparse.Namespace, max_tokens: int, log: Any) -> dict[str, Any]:
    """The n-gram proposers replayed on the standard engine's greedy outputs."""
    from ridgeline.engine import LLMEngine
    from ridgeline.engine.config import SpeculativeConfig
    from ridgeline.engine.spec_decode.cost_model import StepCost
    from ridgeline.engine.spec_decode.proposers import NgramProposer
    from ridgeline.engine.spec_decode.replay import ReplayStats, replay_greedy

    torch.set_num_threads(args.threads)
    cache = args.replay_cache
    cached = None
    if cache and os.path.exists(cache):
        with open(cache) as f:
            cached = json.load(f)
        if cached.get("max_tokens") != max_tokens or cached.get("quick") != args.quick:
            cached = None
    if cached is None:
        engine = LLMEngine(base_config(args))
        work = tokenized(engine.tokenizer, args.quick)
        outputs: dict[str, list[list[int]]] = {kind: [] for kind in work}
        for kind, items in work.items():
            for i, ids in enumerate(items):
                outputs[kind].append(run_one(engine, ids, max_tokens)["tokens"])
                log(f"{kind}[{i}] standard: {len(outputs[kind][-1])} tokens")
        cached = {"max_tokens": max_tokens, "quick": args.quick, "prompts": work,
                  "outputs": outputs}
        if cache:
            with open(cache, "w") as f:
                json.dump(cached, f)
    work, outputs = cached["prompts"], cached["outputs"]

    modes = {"lookup": SpeculativeConfig(method="ngram", ngram_mode="lookup"),
             "suffix": SpeculativeConfig(method="ngram")}
    out: dict[str, Any] = {"model": args.model, "max_tokens": max_tokens, "quick": args.quick,
                           "machine": machine(args.threads), "date": date.today().isoformat(),
                           "configs": {m: c.model_dump() for m, c in modes.items()}}
    for ratio in [float(r) for r in args.cost_ratios.split(",")]:
        cost = StepCost(fixed=(1.0, ratio))
        for mode, cfg in modes.items():
            proposer = NgramProposer(cfg)  # one per replay: it learns as it goes
            row: dict[str, Any] = {}
            for kind, items in work.items():
                st = ReplayStats()
                for ids, toks in zip(items, outputs[kind]):
                    replay_greedy(proposer, cfg, cost, ids, toks, max_tokens, st)
                # plain decoding pays a + b per token; speculation a + b (1 + k) per pass
                spent = st.passes * (1 + ratio) + ratio * st.proposed
                row[kind] = dict(pass_stats(st.passes, st.emitted, st.proposed, st.accepted),
                                 modelled_speedup=round(st.emitted * (1 + ratio) / spent, 3),
                                 proposer_us_per_call=round(
                                     1e6 * st.proposer_seconds / max(1, st.proposer_calls), 1))
            out[f"ratio_{ratio}_{mode}"] = row
            log(f"b/a={ratio} {mode}: {row}")
    # "text": the workloads' prompts and outputs, repeated (matches everywhere); "novel":
    # random tokens (nothing recurs: lookup scans every n-gram length)
    text = [t for kind in work for ids, toks in zip(work[kind], outputs[kind])
            for t in ids + toks]
    rng = random.Random(0)
    novel = [rng.randrange(1000, 40000) for _ in range(8192 + 400)]
    out["proposer_us_per_call"] = {
        mode: {f"{name}_{n}": proposer_cost(cfg, ctx, n) for name, ctx in
               (("text", text), ("novel", novel)) for n in (2048, 8192)}
        for mode, cfg in modes.items()}
    return out


def proposer_cost(cfg: Any, text: list[int], n_ctx: int, steps: int = 300) -> dict[str, float]:
    """Microseconds per proposer call on a context of n_ctx tokens (`text`, repeated as
    needed) as it grows by a token per call (median and mean), and the milliseconds of the
    first call (which indexes the whole context in mode suffix)."""
    from ridgeline.engine import SamplingParams
    from ridgeline.engine.sequence import Sequence
    from ridgeline.engine.spec_decode.proposal import SpecState
    from ridgeline.engine.spec_decode.proposers import NgramProposer

    proposer = NgramProposer(cfg)
    toks = text * (n_ctx // len(text) + 2)
    seq = Sequence("cost", 0, toks[:n_ctx], n_ctx // 2, SamplingParams(temperature=0))
    states = {seq: SpecState()}
    k = cfg.num_speculative_tokens
    start = time.perf_counter()
    proposer.propose([(seq, k)], states, None)
    first = time.perf_counter() - start
    times = []
    for t in toks[n_ctx:n_ctx + steps]:
        seq.token_ids.append(t)
        start = time.perf_counter()
        proposer.propose([(seq, k)], states, None)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median_us": round(1e6 * times[len(times) // 2], 1),
            "mean_us": round(1e6 * sum(times) / len(times), 1),
            "first_call_ms": round(1e3 * first, 2)}


if __name__ == "__main__":
    main()
