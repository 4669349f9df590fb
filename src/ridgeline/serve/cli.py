"""`ridgeline serve`: the OpenAI-compatible server (`register(app)` adds the command)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import typer


def serve(
    model: str = typer.Option("default", "--model", "-m",
                              help="Model name or path (\"default\" is SmolLM2-135M-Instruct)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="RIDGELINE_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Name clients use (default: the --model value)."),
    config: Path | None = typer.Option(None, "--config", "-c", exists=True, dir_okay=False,
                                       help="EngineConfig YAML; flags below override it."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", min=1),
    kv_cache_memory_mb: float | None = typer.Option(None, "--kv-cache-memory-mb", min=1),
    max_num_seqs: int | None = typer.Option(None, "--max-num-seqs", min=1),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads."),
    dtype: str | None = typer.Option(None, "--dtype",
                                     help="float32 (default) or bfloat16 (AVX512_BF16)."),
    weight_quant: str | None = typer.Option(None, "--weight-quant",
                                            help="none (default) or int8 (needs bfloat16)."),
    fast: bool = typer.Option(True, "--fast/--no-fast",
                              help="Also serve <model>:fast (speculative decoding; the "
                              "same greedy output as <model>)."),
    fast_q: bool = typer.Option(False, "--fast-q",
                                help="Also serve <model>:fast-q (speculation, int8 KV cache "
                                "and int8 weights: faster, outputs may differ near ties)."),
    # Request limits; left unset, ServerLimits' defaults apply (in brackets).
    max_body_bytes: int | None = typer.Option(
        None, "--max-body-bytes", min=1, help="Largest request body, larger get 413 [4 MiB]."),
    max_prompts: int | None = typer.Option(
        None, "--max-prompts", min=1, help="Most prompts per /v1/completions request [64]."),
    max_n: int | None = typer.Option(None, "--max-n", min=1,
                                     help="Most samples (n, best_of) per prompt [16]."),
    max_choices: int | None = typer.Option(
        None, "--max-choices", min=1, help="Most choices (n times prompts) per request [256]."),
    enable_weight_updates: bool = typer.Option(
        False, "--enable-weight-updates",
        help="Accept new weights on POST /v1/weights (RL with rollouts on this server). "
        "Whoever can call it decides what the model says: give an --api-key too."),
    tool_call_parser: str | None = typer.Option(
        None, "--tool-call-parser",
        help="How tool calls are read from replies: hermes, llama3_json, mistral, "
        "qwen3_coder, deepseek_v3, kimi_k2 or gpt_oss (default: from the chat template, "
        "else hermes)."),
    reasoning_parser: str | None = typer.Option(
        None, "--reasoning-parser",
        help="How reasoning is split into reasoning_content: deepseek_r1, qwen3, gpt_oss "
        "or none (default: from the chat template)."),
    log_level: str = typer.Option("info", "--log-level"),
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (chat, completions, streaming,
    tools, /v1/models, /health, /metrics)."""
    import uvicorn
    from rich.console import Console

    from ridgeline.config import load_config, load_model
    from ridgeline.engine.config import EngineConfig
    from ridgeline.llm.parsers import check_reasoning_parser, check_tool_call_parser
    from ridgeline.serve.app import build_engines, create_app
    from ridgeline.serve.protocol import ServerLimits

    values: dict[str, object] = {}
    if config is not None:
        values = load_config(EngineConfig, config).model_dump(exclude_unset=True)
    if model != "default" or "model" not in values:  # the flag wins unless left at its default
        values["model"] = model
    for key, value in (("max_model_len", max_model_len), ("kv_cache_memory_mb", kv_cache_memory_mb),
                       ("max_num_seqs", max_num_seqs), ("num_threads", threads),
                       ("dtype", dtype), ("weight_quant", weight_quant)):
        if value is not None:
            values[key] = value
    engine_config = load_model(EngineConfig, values, source="serve options")
    given = {"max_body_bytes": max_body_bytes, "max_prompts": max_prompts, "max_n": max_n,
             "max_choices": max_choices}
    limits = load_model(ServerLimits, {k: v for k, v in given.items() if v is not None},
                        source="serve options")
    # Names and the port are checked before the slow model load.
    if tool_call_parser is not None:
        check_tool_call_parser(tool_call_parser)
    if reasoning_parser is not None:
        check_reasoning_parser(reasoning_parser)
    _check_port(host, port)
    name = served_model_name or engine_config.model
    console = Console(stderr=True)
    with console.status(f"loading {engine_config.model}"):
        engines = build_engines(engine_config, name, fast=fast, fast_q=fast_q)
    app = create_app(engines, api_key=api_key or None, limits=limits,
                     weight_updates=enable_weight_updates, tool_call_parser=tool_call_parser,
                     reasoning_parser=reasoning_parser)
    console.print(f"serving {', '.join(engines)} on http://{host}:{port}/v1"
                  + (" (API key required)" if api_key else "")
                  + (", weight updates on" if enable_weight_updates else ""), highlight=False)
    if enable_weight_updates and not api_key and host not in ("127.0.0.1", "::1", "localhost"):
        console.print(f"[yellow]warning:[/] anyone who reaches {host}:{port} can replace the "
                      "model's weights; pass --api-key", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=5)


def _check_port(host: str, port: int) -> None:
    from ridgeline.errors import ConfigError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                              hint="pick another --port or stop what is using it") from None


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


if __name__ == "__main__":  # python -m ridgeline.serve.cli --model default
    standalone = typer.Typer(add_completion=False)
    standalone.callback()(lambda: None)  # a group, so that "serve" stays a subcommand
    register(standalone)
    standalone(prog_name="ridgeline", args=["serve", *sys.argv[1:]])
