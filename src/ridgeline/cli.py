"""The `ridgeline` command line: one Typer app; each subsystem's subcommands live beside
the code they drive (`ridgeline/<subsystem>/cli.py`) and are mounted here."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from ridgeline import __version__
from ridgeline.errors import RidgelineError

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


def _mount_subcommands() -> None:
    # Each subsystem contributes a Typer app; missing ones (not built yet) are skipped.
    import importlib

    mounts = [
        ("ridgeline.sandbox.cli", "sandbox", "Isolated sandboxes: run, shell, bench."),
        ("ridgeline.engine.cli", None, None),
        ("ridgeline.engine.serve_cli", None, None),
        ("ridgeline.tasks.cli", "tasks", "Terminal tasks: list and quality-check."),
        ("ridgeline.eval.cli", None, None),
    ]
    for module, name, help_text in mounts:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                continue
            raise
        register = getattr(mod, "register", None)
        if register is not None:
            register(app)
        else:
            app.add_typer(mod.app, name=name, help=help_text)


_mount_subcommands()


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
