"""`ridgeline eval`: an agent on a task suite in parallel sandboxes, with a progress bar,
`results.json`, a Markdown report and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ridgeline.errors import ConfigError
from ridgeline.tasks.verifier import VerdictStatus

console = Console()


def eval_command(
    tasks: str = typer.Option("builtin", "--tasks", help="'builtin', 'demo' (a representative slice), 'toolbench', a task dir or a suite dir."),
    agent: str = typer.Option("llm", "--agent", help="llm | oracle | null."),
    model: str = typer.Option("default", "--model", help="'default', a model path, a training run's directory (its checkpoint), or an OpenAI-compatible base URL."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model name sent to a URL endpoint."),
    concurrency: int = typer.Option(4, "--concurrency", "-c", min=1, help="Episodes at once."),
    samples: int = typer.Option(1, "--samples", "-k", min=1, help="Samples per task (pass@k)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Only the first N tasks."),
    task_id: list[str] = typer.Option([], "--task", help="Only this task id (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default runs/eval-...)."),
    backend: str = typer.Option("bwrap", "--backend", help="Sandbox backend: bwrap | local | docker."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Agent step limit."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Max tokens per model reply."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0, help="Sampling temperature (default: the agent's, greedy)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (0 < p <= 1)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed; each (task, sample) derives its own from it."),
    action_format: Optional[str] = typer.Option(None, "--action-format", help="auto | text | tool_calls (tool calls work with any model: Hermes blocks in the text where the template has no tools)."),
    constrained_tool_calls: bool = typer.Option(True, "--constrained-tool-calls/--free-tool-calls", help="With tool calls, one call per reply held to the tools' schemas by a grammar (the engine, or the server's tool_choice)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
) -> None:
    """Run an agent on a task suite and grade it with the tasks' tests."""
    from ridgeline.agent import AgentConfig
    from ridgeline.eval.results import summary_json
    from ridgeline.eval.runner import EvalConfig

    if agent not in ("llm", "oracle", "null"):
        raise ConfigError(f"unknown agent {agent!r}", hint="use llm, oracle or null")
    agent_config = AgentConfig(constrained_tool_calls=constrained_tool_calls)
    if action_format is not None:
        if action_format not in ("auto", "text", "tool_calls"):
            raise ConfigError(f"unknown --action-format {action_format!r}",
                              hint="use auto, text or tool_calls")
        agent_config.action_format = action_format   # type: ignore[assignment]
    if max_steps is not None:
        agent_config.step_limit = max_steps
    if top_p is not None and top_p <= 0:
        raise ConfigError("--top-p must be above 0", hint="use a value in (0, 1]")
    updates = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature),
                                 ("top_p", top_p), ("seed", seed)) if v is not None}
    agent_config.sampling = agent_config.sampling.model_copy(update=updates)
    config = EvalConfig(tasks=tasks, agent=agent, model=model, model_name=model_name,
                        concurrency=concurrency, samples=samples, limit=limit, task_ids=task_id,
                        out=out, backend=backend, agent_config=agent_config)
    if tasks == "toolbench":
        from ridgeline.eval.toolbench.runner import run_toolbench as runner
    else:
        from ridgeline.eval.runner import run_eval as runner

    progress = Progress(TextColumn("[bold]eval[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("passed {task.fields[passed]}"), TimeElapsedColumn(),
                        console=Console(stderr=True), disable=as_json, transient=False)
    with progress:
        bar = progress.add_task(f"{agent} on {tasks}", total=None, passed=0)
        passed = 0

        def on_result(res) -> None:
            nonlocal passed
            passed += res.status is VerdictStatus.PASSED
            progress.update(bar, advance=1, passed=passed, description=f"{agent} on {tasks}: {res.task_id}")

        run = runner(config, on_result=on_result, on_start=lambda n: progress.update(bar, total=n))

    if as_json:
        typer.echo(json.dumps(summary_json(run.summary, {"out_dir": str(run.out_dir)})))
        return
    s = run.summary
    table = Table(title=f"{agent} on {tasks}")
    for col in ("domain", "passed", "scored", "pass rate"):
        table.add_column(col, justify="left" if col == "domain" else "right")
    for dom, info in s.by_domain.items():
        table.add_row(dom, str(int(info["passed"])), str(int(info["scored"])), f"{100 * info['pass_rate']:.0f}%")
    console.print(table)
    n_broken = s.n_broken
    # beside the scored rate, always: a suite mostly unsupported is not a 100% pass
    console.print(f"[bold]pass rate over all tasks {100 * s.pass_rate_all:.1f}%[/] "
                  f"({s.n_passed}/{s.n_episodes + n_broken * samples} episodes; "
                  f"unsupported, broken and infra errors count as not passed)")
    console.print(f"[bold]pass rate {100 * s.pass_rate:.1f}%[/] of scored episodes "
                  f"({s.n_passed}/{s.n_scored} scored; "
                  f"{s.n_infra_error} infra errors, {s.n_unsupported} unsupported, "
                  f"{n_broken} broken) "
                  + " ".join(f"{k}={100 * v:.1f}%" for k, v in s.pass_at_k.items())
                  + (f" (pass@1 95% interval {100 * s.pass_at_1_ci95[0]:.1f}-"
                     f"{100 * s.pass_at_1_ci95[1]:.1f}%)" if s.pass_at_1_ci95 else ""))
    for task_id, why in s.unsupported_tasks.items():
        console.print(f"[yellow]unsupported[/] {task_id}: {why}", highlight=False,
                      soft_wrap=True)
    for task_id, why in s.broken_tasks.items():
        console.print(f"[red]broken[/] {task_id}: {why}", highlight=False, soft_wrap=True)
    console.print(f"report: {run.files['report']}  results: {run.files['results']}")


def register(app: typer.Typer) -> None:
    from ridgeline.eval.compare import compare_command

    app.command("eval")(eval_command)
    app.command("eval-compare")(compare_command)
