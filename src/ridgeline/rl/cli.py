"""`ridgeline train --config FILE [--resume] [--nproc N]`: an RL run with a progress bar per
step (the trainer sharded over N processes with --nproc, `sharded.py`);
`ridgeline train export RUN_DIR OUT_DIR`: the run's policy as a Hugging Face directory;
`ridgeline sft --config FILE [--resume]`: supervised fine-tuning on agent episodes.
Metrics, TensorBoard events, plots and checkpoints under the run directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from ridgeline.rl.config import TrainConfig

console = Console(stderr=True)


def train_command(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Training config (YAML or JSON)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (overrides the config's `out`)."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Train steps in all (overrides the config)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary at the end, no progress bar."),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Trainer processes (FSDP2 over them; overrides distributed.nproc). Under torchrun: its ranks."),
) -> None:
    """Train the policy with asynchronous RL on verifiable tasks."""
    if ctx.invoked_subcommand is not None:
        return
    if config is None:
        raise typer.BadParameter("missing option --config", param_hint="--config")
    from ridgeline.errors import ConfigError
    from ridgeline.rl import sharded
    from ridgeline.rl.run import load_train_config

    cfg = load_train_config(config)
    update: dict[str, object] = {k: v for k, v in (("out", out), ("steps", steps))
                                 if v is not None}
    if nproc is not None:
        update["distributed"] = cfg.distributed.model_copy(update={"nproc": nproc})
    cfg = cfg.model_copy(update=update)
    if cfg.distributed.nproc > 1 or sharded.launched_by_torchrun():
        if cfg.ray.enabled:
            raise ConfigError("--nproc with ray.enabled", hint="the sharded trainer runs in "
                              "the processes --nproc starts; set ray.enabled: false")
        sharded.launch(cfg.distributed.nproc, _train_rank, (cfg, resume, as_json),
                       cfg.distributed)
        return
    _train_and_report(cfg, resume, as_json)


def _train_rank(cfg: TrainConfig, resume: bool, as_json: bool) -> None:
    """One rank of `train --nproc N`: rank 0 runs (and reports) the run, the others follow
    its trainer calls."""
    from ridgeline.rl import sharded
    from ridgeline.rl.run import follow

    env = sharded.current()
    assert env is not None
    if env.rank == 0:
        _train_and_report(cfg, resume, as_json)
    else:
        follow(cfg)


def _train_and_report(cfg: TrainConfig, resume: bool, as_json: bool) -> None:
    from ridgeline.rl.run import train
    from ridgeline.rl.run_log import format_progress

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


def export_command(
    run_dir: Path = typer.Argument(..., help="A run directory of `ridgeline train`."),
    out_dir: Path = typer.Argument(..., help="Where to write the Hugging Face directory."),
) -> None:
    """Write the policy of the run's newest checkpoint (whole or sharded, any world size)
    as a Hugging Face directory transformers and the engine load."""
    from ridgeline.rl.run import export

    path = export(run_dir, out_dir)
    console.print(f"exported the policy of {run_dir} to {path}")


def register(app: typer.Typer) -> None:
    train = typer.Typer(invoke_without_command=True, no_args_is_help=False)
    train.callback()(train_command)
    train.command("export")(export_command)
    app.add_typer(train, name="train")
    app.command("sft")(sft_command)
