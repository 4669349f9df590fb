"""The `ridgeline` command line: one Typer app; each subsystem's subcommands live beside
the code they drive (`ridgeline/<subsystem>/cli.py`) and are mounted here, each by name."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from ridgeline import __version__
from ridgeline.engine import cli as engine_cli
from ridgeline.errors import RidgelineError
from ridgeline.eval import cli as eval_cli
from ridgeline.platform import cli as platform_cli
from ridgeline.rl import cli as rl_cli
from ridgeline.sandbox import cli as sandbox_cli
from ridgeline.serve import cli as serve_cli
from ridgeline.tasks import cli as tasks_cli

app = typer.Typer(
    name="ridgeline",
    help="Ridgeline: sandboxes, inference engine, coding agents, evaluation, RL and serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ridgeline {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Ridgeline command line."""


# Every subsystem's commands, imported above without a guard: a subcommand whose module
# fails to import stops `ridgeline` with that ImportError instead of vanishing from --help.
app.add_typer(sandbox_cli.app, name="sandbox", help="Isolated sandboxes: run, shell, bench.")
engine_cli.register(app)
serve_cli.register(app)
app.add_typer(tasks_cli.app, name="tasks", help="Terminal tasks: list and quality-check.")
eval_cli.register(app)
rl_cli.register(app)
platform_cli.register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user mistakes become one red line and exit code 2. Usage errors are
    handled by click itself (standalone mode, also exit code 2)."""
    try:
        app(args=argv)
    except RidgelineError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
