"""`ridgeline train --config FILE [--resume]`: an RL run with a progress bar per step;
`ridgeline sft --config FILE [--resume]`: supervised fine-tuning on agent episodes.
Metrics, TensorBoard events, plots and checkpoints under the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)


def train_command(
    config: Path = typer.Option(..., "--config", "-c", help="Training config (YAML or JSON)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (overrides the config's `out`)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Train steps in all (overrides the config)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary at the end, no progress bar."),
) -> None:
    """Train the policy with asynchronous RL on verifiable tasks."""
    from ridgeline.rl.run import load_train_config, train
    from ridgeline.rl.run_log import format_progress

    cfg = load_train_config(config)
    update = {k: v for k, v in (("out", out), ("steps", steps)) if v is not None}
    cfg = cfg.model_copy(update=update)
    progress = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=console, disable=as_json, transient=False)
    with progress:
        bar = progress.add_task("starting (model, tasks, quality checks)", total=cfg.steps)

        def on_step(step: int, metrics: dict) -> None:
            progress.update(bar, completed=step + 1,
                            description=format_progress(step, cfg.steps, metrics))

        result = train(cfg, resume=resume, on_step=on_step)
    summary = {"run_dir": str(result.run_dir), "steps_done": result.steps_done,
               "evals": [{k: e[k] for k in ("step", "pass_rate")} for e in result.evals],
               "excluded_tasks": result.excluded}
    if as_json:
        typer.echo(json.dumps(summary))
        return
    last = result.history[-1] if result.history else {}
    console.print(f"[bold]{result.steps_done}/{cfg.steps} steps[/] in {result.run_dir}"
                  + (f"; last reward {last['reward_mean']:.3f}" if "reward_mean" in last else ""))
    for e in result.evals:
        rate = "n/a" if e["pass_rate"] is None else f"{100 * e['pass_rate']:.1f}%"
        console.print(f"held-out pass rate after {e['step']} steps: {rate}")
    if result.excluded:
        console.print(f"{len(result.excluded)} tasks left out by the quality check "
                      f"(see {result.run_dir / 'excluded_tasks.json'})")
    console.print(f"checkpoint: {result.run_dir / 'checkpoint'}  (ridgeline eval --model "
                  f"{result.run_dir / 'checkpoint'})")


def sft_command(
    config: Path = typer.Option(..., "--config", "-c", help="SFT config (YAML or JSON)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (overrides the config's `out`)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary at the end, no progress output."),
) -> None:
    """Supervised fine-tuning on agent episodes (oracle solutions, episode files,
    rejection sampling), in the token format RL samples."""
    from ridgeline.rl.sft import load_sft_config, sft

    cfg = load_sft_config(config)
    if out is not None:
        cfg = cfg.model_copy(update={"out": out})
    with console.status("SFT: quality checks and oracle episodes", spinner="dots") as status:
        def on_step(step: int, metrics: dict) -> None:
            status.update(f"SFT step {step + 1}: nll {metrics['sft/nll']:.3f} on "
                          f"{int(metrics['policy_tokens'])} tokens")

        result = sft(cfg, resume=resume, on_step=None if as_json else on_step)
    summary = {"run_dir": str(result.run_dir), "steps_done": result.steps_done,
               "episodes": result.episodes, "excluded_tasks": result.excluded}
    if as_json:
        typer.echo(json.dumps(summary))
        return
    last = result.history[-1] if result.history else {}
    console.print(f"[bold]{result.steps_done} steps[/] in {result.run_dir} on "
                  + ", ".join(f"{n} {k} episodes" for k, n in result.episodes.items())
                  + (f"; last nll {last['sft/nll']:.3f}" if "sft/nll" in last else ""))
    if result.excluded:
        console.print(f"{len(result.excluded)} tasks gave no episode "
                      f"(see {result.run_dir / 'excluded_tasks.json'})")
    console.print(f"checkpoint: {result.run_dir / 'checkpoint'}  (RL from it: policy.model "
                  f"{result.run_dir}; ridgeline eval --model {result.run_dir})")


def register(app: typer.Typer) -> None:
    app.command("train")(train_command)
    app.command("sft")(sft_command)
