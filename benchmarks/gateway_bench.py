"""Gateway overhead: the latency of a chat completion sent straight to an upstream versus
through the gateway to the same upstream, in the same run.

    python benchmarks/gateway_bench.py --json                    # 2000 requests each way
    python benchmarks/gateway_bench.py --json --quick            # 300 each way
    python benchmarks/gateway_bench.py --json --ridgeline-serve  # also a real `ridgeline serve`

The upstream is a stub OpenAI-compatible server in its own process (uvicorn, a fixed
small completion with usage, no model): it answers in a fraction of a millisecond, so
the difference between the two paths is the gateway's own cost: its HTTP server, key
check, quotas, routing, JSON handling, and its second HTTP hop. The gateway runs in a
process of its own too (`create_gateway_app` under uvicorn, an API key with rpm, tpm and
concurrency limits, usage accounting on), and the client here is one keep-alive httpx
connection per path, alternating direct and gateway requests so that load from other
processes hits both. Every gateway answer is checked to be the upstream's.

With `--ridgeline-serve` the same comparison runs against `ridgeline serve` with the
default model (SmolLM2-135M-Instruct, one greedy token per request, `--no-fast`).

Reported: p50 and p99 per path, the overhead at p50 (gateway p50 minus direct p50) and
the median of the per-pair differences, in milliseconds (goal: overhead p50 < 2 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_common import machine

GOAL_MS = 2.0
STUB_MODEL = "stub"
COMPLETION = {
    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": STUB_MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there."},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
}
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello in two words."}]


# ---- the stub upstream (its own process) -------------------------------------------------------


def stub_app() -> Any:
    """A raw ASGI OpenAI-compatible server: /v1/models, and a fixed chat completion
    (whole, or streamed in three chunks plus usage when asked)."""
    whole = json.dumps(COMPLETION).encode()
    models = json.dumps({"object": "list", "data": [
        {"id": STUB_MODEL, "object": "model", "owned_by": "bench"}]}).encode()

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        body = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                "model": STUB_MODEL, "choices": [{"index": 0, "delta": delta,
                                                  "finish_reason": finish}], **extra}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].split(".")[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            await _reply(send, 200, models)
            return
        request = json.loads(raw or b"{}")
        if not request.get("stream"):
            await _reply(send, 200, whole)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for part in (chunk({"role": "assistant", "content": ""}), chunk({"content": "Hello"}),
                     chunk({"content": " there."}, "stop")):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        if (request.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0,
                     "model": STUB_MODEL, "choices": [], "usage": COMPLETION["usage"]}
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + json.dumps(usage).encode() + b"\n\n"})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


async def _reply(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def run_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app(), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def run_gateway(port: int, config_path: str, db: str) -> None:
    import uvicorn

    from ridgeline.config import load_config
    from ridgeline.platform.gateway import GatewayConfig, create_gateway_app
    from ridgeline.platform.keys import KeyStore

    config = load_config(GatewayConfig, config_path)
    app = create_gateway_app(config, KeyStore(db))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---- the measuring side ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_ready(proc: subprocess.Popen[str], url: str, timeout: float = 300.0,
               headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"{url}: the server exited: {output}")
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def compare(direct_url: str, gateway_url: str, key: str, body: dict[str, Any], n: int,
            warmup: int, say: Any) -> dict[str, Any]:
    """`n` pairs of requests, direct then through the gateway, each on its own keep-alive
    connection; latencies in ms."""
    direct_ms: list[float] = []
    gateway_ms: list[float] = []
    mismatches = 0
    with httpx.Client(timeout=60) as direct, \
            httpx.Client(timeout=60, headers={"authorization": f"Bearer {key}"}) as gateway:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            a = direct.post(direct_url, json=body)
            t1 = time.perf_counter()
            b = gateway.post(gateway_url, json=body)
            t2 = time.perf_counter()
            if a.status_code != 200 or b.status_code != 200:
                raise RuntimeError(f"HTTP {a.status_code} direct, {b.status_code} through the "
                                   f"gateway: {b.text[:300]}")
            if i >= warmup:
                direct_ms.append((t1 - t0) * 1e3)
                gateway_ms.append((t2 - t1) * 1e3)
                ca, cb = a.json()["choices"][0], b.json()["choices"][0]
                mismatches += ca["message"]["content"] != cb["message"]["content"]
            if i and i % 500 == 0:
                say(f"  {i}/{warmup + n}")
    pairs = [g - d for d, g in zip(direct_ms, gateway_ms)]
    return {
        "requests_each_way": n,
        "direct": {"p50_ms": round(pct(direct_ms, 50), 3), "p99_ms": round(pct(direct_ms, 99), 3)},
        "gateway": {"p50_ms": round(pct(gateway_ms, 50), 3),
                    "p99_ms": round(pct(gateway_ms, 99), 3)},
        "overhead_p50_ms": round(pct(gateway_ms, 50) - pct(direct_ms, 50), 3),
        "overhead_p99_ms": round(pct(gateway_ms, 99) - pct(direct_ms, 99), 3),
        "overhead_median_of_pairs_ms": round(statistics.median(pairs), 3),
        "answers_differ": mismatches,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--quick", action="store_true", help="300 requests each way")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--ridgeline-serve", action="store_true",
                    help="also compare against `ridgeline serve` with the default model")
    ap.add_argument("--serve-requests", type=int, default=None)
    # internal: the server processes
    ap.add_argument("--role", choices=["stub", "gateway"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--db", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "stub":
        run_stub(args.port)
        return
    if args.role == "gateway":
        run_gateway(args.port, args.config, args.db)
        return

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import yaml

    from ridgeline.platform.keys import KeyStore
    from ridgeline.platform.limits import KeyLimits

    n = args.requests or (300 if args.quick else 2000)
    warmup = 50 if args.quick else 200
    load_start = os.getloadavg()[0]
    procs: list[subprocess.Popen[str]] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stub_port, gw_port = free_port(), free_port()
        upstreams = [{"name": "stub", "base_url": f"http://127.0.0.1:{stub_port}/v1",
                      "models": [STUB_MODEL]}]
        serve_port = None
        if args.ridgeline_serve:
            serve_port = free_port()
            upstreams.append({"name": "ridgeline-serve", "models": ["default"],
                              "base_url": f"http://127.0.0.1:{serve_port}/v1"})
        config = Path(tmp, "gateway.yaml")
        config.write_text(yaml.safe_dump({"upstreams": upstreams}))
        db = str(Path(tmp, "platform.db"))
        with KeyStore(db) as store:  # the quotas are checked on every request, never hit
            key, _ = store.create("bench", limits=KeyLimits(rpm=10**9, tpm=10**12,
                                                            max_concurrency=1000))
        try:
            say(f"starting the stub upstream on :{stub_port} and the gateway on :{gw_port}")
            procs.append(spawn("--role", "stub", "--port", str(stub_port)))
            wait_ready(procs[-1], f"http://127.0.0.1:{stub_port}/v1/models")
            if serve_port is not None:
                say(f"starting ridgeline serve (default model) on :{serve_port}")
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "ridgeline.serve.cli", "--model", "default",
                     "--port", str(serve_port), "--log-level", "warning", "--no-fast"],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                wait_ready(procs[-1], f"http://127.0.0.1:{serve_port}/health")
            procs.append(spawn("--role", "gateway", "--port", str(gw_port), "--config",
                               str(config), "--db", db))
            wait_ready(procs[-1], f"http://127.0.0.1:{gw_port}/health")
            gw = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            say(f"stub upstream: {n} requests each way (+{warmup} warm-up)")
            body = {"model": STUB_MODEL, "messages": MESSAGES, "max_tokens": 8}
            results["stub_upstream"] = compare(
                f"http://127.0.0.1:{stub_port}/v1/chat/completions", gw, key, body, n, warmup,
                say)
            if serve_port is not None:
                m = args.serve_requests or (30 if args.quick else 200)
                say(f"ridgeline serve: {m} requests each way (+5 warm-up)")
                body = {"model": "default", "messages": MESSAGES, "max_tokens": 1,
                        "temperature": 0}
                results["ridgeline_serve"] = compare(
                    f"http://127.0.0.1:{serve_port}/v1/chat/completions", gw, key, body, m, 5,
                    say)
        finally:
            for proc in reversed(procs):
                stop(proc)  # the gateway writes the last usage as it shuts down
        with KeyStore(db) as store:
            rows = store.usage()
    counted = sum(r.requests for r in rows)
    stub = results["stub_upstream"]
    result = {
        "benchmark": "gateway_bench",
        "upstream": "stub OpenAI-compatible server (uvicorn, fixed completion), own process",
        **results,
        "overhead_p50_ms": stub["overhead_p50_ms"],
        "overhead_goal_p50_ms": GOAL_MS,
        "requests_counted_in_usage": counted,
        "machine": machine(load_avg_at_start=round(load_start, 2), httpx=httpx.__version__),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"direct p50 {stub['direct']['p50_ms']:.3f} ms, through the gateway p50 "
              f"{stub['gateway']['p50_ms']:.3f} ms: overhead {stub['overhead_p50_ms']:.3f} ms "
              f"(goal < {GOAL_MS} ms); p99 {stub['direct']['p99_ms']:.3f} vs "
              f"{stub['gateway']['p99_ms']:.3f} ms")


if __name__ == "__main__":
    main()
