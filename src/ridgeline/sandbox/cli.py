"""`ridgeline sandbox`: run a command in a sandbox, open a shell in one, benchmark them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ridgeline.sandbox.base import Limits, NetworkPolicy, SandboxSpec

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Isolated sandboxes: run, shell, bench.")
err = Console(stderr=True)

BACKEND = typer.Option("bwrap", "--backend", help="bwrap (isolated), local (NO isolation), docker")
NETWORK = typer.Option(NetworkPolicy.NONE, "--network", case_sensitive=False,
                       help="none: no network at all; loopback: only servers inside")
WORKSPACE = typer.Option(None, "--workspace", exists=True, file_okay=False, resolve_path=True,
                         help="seed the workspace with a copy of this directory (it is not changed)")
WORKSPACE_PATH = typer.Option("/workspace", "--workspace-path",
                              help="where the workspace is inside the sandbox")


def _spec(network: NetworkPolicy, workspace: Path | None, workspace_path: str,
          timeout: float | None = None) -> SandboxSpec:
    limits = Limits(wall_timeout_s=timeout) if timeout is not None else Limits()
    return SandboxSpec(network=network, workspace_from=workspace, workspace_path=workspace_path,
                       limits=limits)


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    cmd: list[str] = typer.Argument(..., help="the command and its arguments (after --)"),
    network: NetworkPolicy = NETWORK,
    timeout: float = typer.Option(120.0, "--timeout", min=0.001, help="seconds before it is killed"),
    backend: str = BACKEND,
    workspace: Path | None = WORKSPACE,
    workspace_path: str = WORKSPACE_PATH,
) -> None:
    """Run CMD in a fresh sandbox; print its output and exit with its exit code.

    Example: ridgeline sandbox run --network none -- python3 -c "print(42)"
    """
    from ridgeline.sandbox import create_sandbox

    spec = _spec(network, workspace, workspace_path, timeout)
    with create_sandbox(spec, backend=backend) as sb:
        res = sb.run(cmd, timeout=timeout)
    sys.stdout.buffer.write(res.stdout_bytes)
    sys.stdout.buffer.flush()
    sys.stderr.buffer.write(res.stderr_bytes)
    if res.timed_out:
        err.print(f"[yellow]ridgeline: timed out after {timeout:g} s; every process of the "
                  "command was killed[/]", highlight=False)
    elif res.killed_by:
        err.print(f"[yellow]ridgeline: killed ({res.killed_by})[/]", highlight=False)
    raise typer.Exit(res.exit_code)


@app.command()
def shell(
    network: NetworkPolicy = NETWORK,
    backend: str = BACKEND,
    workspace: Path | None = WORKSPACE,
    workspace_path: str = WORKSPACE_PATH,
) -> None:
    """Open an interactive bash in a fresh sandbox; `exit` ends it.

    The shell gets a terminal of its own. Without a terminal, the script on stdin is run.
    """
    from ridgeline.sandbox import create_sandbox
    from ridgeline.sandbox.terminal import attach

    spec = _spec(network, workspace, workspace_path)
    with create_sandbox(spec, backend=backend) as sb:
        if not sys.stdin.isatty():
            res = sb.run(["bash"], stdin=sys.stdin.buffer.read(), timeout=spec.limits.wall_timeout_s)
            sys.stdout.buffer.write(res.stdout_bytes)
            sys.stdout.buffer.flush()
            sys.stderr.buffer.write(res.stderr_bytes)
            raise typer.Exit(res.exit_code)
        err.print(f"[dim]sandbox {sb.id} ({backend}, network {network.value}); the workspace "
                  f"is {spec.workspace_path}; `exit` ends it[/]", highlight=False)
        code = attach(sb)
    raise typer.Exit(code)


@app.command()
def bench(
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    quick: bool = typer.Option(False, "--quick", help="smaller counts (30 cold starts, 16 at once)"),
    backend: str = BACKEND,
    out: Path | None = typer.Option(None, "--out", help="also write the JSON to this file"),
) -> None:
    """Benchmark cold start, warm pool, 64 concurrent sandboxes and snapshot/restore."""
    from ridgeline.sandbox.bench import BenchConfig, run_bench

    cfg = BenchConfig.quick(backend) if quick else BenchConfig(backend=backend)
    if as_json:
        result = run_bench(cfg)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            def progress(label: str, total: int):
                task = bar.add_task(label, total=total)
                return lambda: bar.advance(task)

            result = run_bench(cfg, progress)
    text = json.dumps(result, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    if as_json:
        print(text)
        return
    _table(result)


def _table(r: dict) -> None:
    t = Table(title=f"ridgeline sandbox bench ({r['backend']}, {r['machine']['cpus']} CPUs, "
                    f"load {r['machine']['load_avg_1m']:.1f})")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("goal", justify="right")
    goals = r["goals"]

    def row(name: str, key: str, unit: str = "ms") -> None:
        g = goals.get(key)
        mark = "" if g is None else ("[green]met[/]" if g["met"] else "[red]missed[/]")
        goal = "" if g is None else f"<= {g['goal_ms']:g} {unit} {mark}"
        t.add_row(name, f"{r[key]:.2f} {unit}", goal)

    row("cold start p50 (create, run true, close)", "cold_start_p50_ms")
    row("cold start p95", "cold_start_p95_ms")
    row("subprocess.run(['true']) p50 (baseline)", "subprocess_p50_ms")
    t.add_row("cold start / subprocess", f"{r['cold_start_vs_subprocess']:.1f}x", "")
    row("run `true` in a running sandbox p50", "exec_p50_ms")
    row("warm pool acquire p50", "warm_acquire_p50_ms")
    row("warm pool acquire p95", "warm_acquire_p95_ms")
    c = r["concurrent"]
    ok = "[green]met[/]" if c["failures"] == 0 else "[red]missed[/]"
    t.add_row(f"{c['sandboxes']} sandboxes at once (python3)",
              f"{c['failures']} failures, {c['seconds']:.2f} s", f"0 failures {ok}")
    ws = r["workspace"]
    t.add_row(f"snapshot ({ws['files']} files, {ws['bytes'] // 2**20} MB)", f"{r['snapshot_ms']:.1f} ms", "")
    row(f"restore after a step ({ws['typical_step']})", "restore_ms")
    t.add_row("restore, nothing changed", f"{r['restore_unchanged_ms']:.1f} ms", "")
    t.add_row("restore, every file changed", f"{r['restore_all_changed_ms']:.1f} ms", "")
    t.add_row("incremental snapshot", f"{r['snapshot_incremental_ms']:.1f} ms", "")
    Console().print(t)
