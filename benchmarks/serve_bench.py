"""Serving overhead: concurrent streaming clients against `ridgeline serve` versus the
offline engine (`LLM.generate`) on the same requests, in the same run.

    python benchmarks/serve_bench.py --json            # 64 clients, 2 alternating rounds
    python benchmarks/serve_bench.py --json --quick    # 16 clients, 1 round

The server is a real `ridgeline serve` process on loopback (the default model,
SmolLM2-135M-Instruct); the clients are asyncio httpx streams in this process. Every
request is a greedy chat completion with a fixed number of new tokens (`ignore_eos`), so
both sides do the same engine work; the prompts the server tokenised are checked against
the offline ones. Rounds alternate offline and server so that load from other processes
on a shared machine hits both.

Reported: output tokens/s, p50 and p99 time to first token (offline: from submission to
the first token inside the engine; server: from sending the request to the first token
arriving at the client), and the server overhead, `offline_tps / server_tps - 1` in %,
from the medians over rounds (goal: under 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np
from bench_common import machine, on_worker_thread

TOPICS = ["binary search", "a TCP handshake", "garbage collection", "unit tests", "git rebase",
          "hash maps", "recursion", "a REST API", "shell pipes", "file permissions",
          "virtual memory", "regular expressions", "JSON parsing", "race conditions",
          "code review", "a Makefile"]


def make_messages(n: int) -> list[list[dict[str, str]]]:
    """Distinct short chat prompts (no two share more than the template's prefix)."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append([{"role": "user",
                     "content": f"Request {i}: explain {topic} in two sentences for a new "
                                f"engineer (variant {i // len(TOPICS)})."}])
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the two sides ---------------------------------------------------------------------


def run_offline(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """`LLM.generate` on a worker thread, where the server steps its engine too: on a
    loaded machine, torch's 2-thread matmuls issued from the main thread ran several
    times slower than the same calls from another thread, which would flatter the server."""
    from ridgeline.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = on_worker_thread(lambda: llm.generate(prompts, params), "offline-engine")
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "outputs": [o.outputs[0].token_ids for o in outs]}


async def _one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    prompt_ids = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
            for choice in chunk["choices"]:
                new = choice.get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += new
    return {"ttft": ttft, "ids": ids, "prompt_ids": prompt_ids}


async def run_server(base_url: str, messages: list[list[dict[str, str]]],
                     max_tokens: int) -> dict[str, Any]:
    url = base_url + "/chat/completions"
    limits = httpx.Limits(max_connections=len(messages) + 8,
                          max_keepalive_connections=len(messages) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        bodies = [{"model": "default", "messages": m, "max_tokens": max_tokens,
                   "temperature": 0, "ignore_eos": True, "stream": True,
                   "return_token_ids": True} for m in messages]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one_stream(client, url, b) for b in bodies))
        wall = time.perf_counter() - t0
    tokens = sum(len(r["ids"]) for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "outputs": [r["ids"] for r in results],
            "prompt_ids": [r["prompt_ids"] for r in results]}


def start_server(port: int, engine_args: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "ridgeline.serve.cli", "--model", "default",
           "--port", str(port), "--log-level", "warning", "--no-fast", *engine_args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"ridgeline serve exited: {output}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("ridgeline serve did not become healthy")


# ---- main ------------------------------------------------------------------------------


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("wall_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s")
    out = {k: round(statistics.median(r[k] for r in rounds), 4) for k in keys}
    out["output_tokens"] = rounds[0]["output_tokens"]
    out["tokens_per_s_by_round"] = [round(r["tokens_per_s"], 2) for r in rounds]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--quick", action="store_true", help="16 clients, 8 tokens, 1 round")
    ap.add_argument("--clients", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--kv-cache-memory-mb", type=float, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    clients = args.clients or (16 if args.quick else 64)
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    rounds = args.rounds or (1 if args.quick else 2)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from ridgeline.engine import LLM
    from ridgeline.llm.base import Message
    from ridgeline.llm.chat_template import encode_chat

    engine_args = ["--kv-cache-memory-mb", str(args.kv_cache_memory_mb),
                   "--max-num-seqs", str(max(clients, 1))]
    if args.threads:
        engine_args += ["--threads", str(args.threads)]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    load_start = os.getloadavg()[0]
    say(f"starting ridgeline serve on {base} and loading the offline engine")
    proc = start_server(port, engine_args)
    try:
        llm = LLM("default", kv_cache_memory_mb=args.kv_cache_memory_mb,
                  max_num_seqs=max(clients, 1), num_threads=args.threads)
        wait_healthy(proc, base)
        messages = make_messages(clients)
        tok = llm.tokenizer
        # The ids the server makes of each conversation (both call `encode_chat`).
        prompts = [encode_chat(tok, [Message(**m) for m in conv]) for conv in messages]
        # warm-up on both sides (first-call allocations, connection setup)
        run_offline(llm, prompts[:2], 2)
        asyncio.run(run_server(base + "/v1", messages[:2], 2))

        offline_rounds, server_rounds = [], []
        same_prompts = True
        identical = []
        for r in range(rounds):
            say(f"round {r + 1}/{rounds}: offline engine, {clients} requests x {max_tokens} tokens")
            off = run_offline(llm, prompts, max_tokens)
            say(f"  offline {off['tokens_per_s']:.1f} tok/s; now {clients} streaming clients")
            srv = asyncio.run(run_server(base + "/v1", messages, max_tokens))
            say(f"  server  {srv['tokens_per_s']:.1f} tok/s")
            same_prompts &= srv["prompt_ids"] == prompts
            identical += [a == b for a, b in zip(off["outputs"], srv["outputs"])]
            offline_rounds.append(off)
            server_rounds.append(srv)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    offline, server = summarise(offline_rounds), summarise(server_rounds)
    overhead = (offline["tokens_per_s"] / server["tokens_per_s"] - 1.0) * 100.0
    result = {
        "benchmark": "serve_bench",
        "model": "SmolLM2-135M-Instruct (default)",
        "clients": clients,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "prompt_tokens_mean": round(statistics.mean(len(p) for p in prompts), 1),
        "offline": offline,
        "server": server,
        "output_tokens_per_s": server["tokens_per_s"],
        "ttft_p50_s": server["ttft_p50_s"],
        "ttft_p99_s": server["ttft_p99_s"],
        "server_overhead_pct": round(overhead, 2),
        "overhead_goal_pct": 10.0,
        "same_prompts": same_prompts,
        "greedy_identical_fraction": round(sum(identical) / max(len(identical), 1), 4),
        "machine": machine(load_avg_at_start=round(load_start, 2)),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"offline {offline['tokens_per_s']:.1f} tok/s, server {server['tokens_per_s']:.1f} "
              f"tok/s, overhead {overhead:.1f}% (goal < 10%), server TTFT p50 "
              f"{server['ttft_p50_s']:.2f}s p99 {server['ttft_p99_s']:.2f}s")


if __name__ == "__main__":
    main()
