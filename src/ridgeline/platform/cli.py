"""`ridgeline platform ...`: the API server, workers, keys and maintenance.

    ridgeline platform serve  --config platform.yaml            # gateway, tasks, RAG, dashboard
    ridgeline platform worker --config platform.yaml            # agent workers
    ridgeline platform keys create --config platform.yaml --tenant acme --user alice

The heavy modules (FastAPI, Qdrant, the tools) load inside the commands, so `ridgeline
--help` stays fast.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="The agent platform: gateway, agent tasks, workers, RAG.")
keys_app = typer.Typer(add_completion=False, no_args_is_help=True, help="API keys.")
app.add_typer(keys_app, name="keys")
console = Console(stderr=True)

ConfigOption = typer.Option(None, "--config", "-c", envvar="RIDGELINE_PLATFORM_CONFIG",
                            help="platform YAML (default: everything embedded under "
                            "./platform-data)")


def _load(config: Path | None):  # -> PlatformConfig
    from ridgeline.platform.config import PlatformConfig
    return PlatformConfig.load(config)


@contextlib.contextmanager
def _key_store(cfg):  # -> Iterator[KeyStore], in the platform's database (or keys.path's)
    from ridgeline.platform.db import open_database
    from ridgeline.platform.keys import KeyStore
    from ridgeline.platform.legacy import adopt_legacy_files

    cfg.prepare()
    own = cfg.separate_database("keys")
    db = None if own else open_database(cfg.database(), pool_size=2)
    try:
        if db is not None:   # the keys of an older version's keys.db, as the server would
            adopt_legacy_files(db, cfg.data_dir, ["keys"])
        store = KeyStore.from_config(cfg.keys.model_copy(update={"path": own}), db=db)
        try:
            yield store
        finally:
            store.close()
    finally:
        if db is not None:
            db.close()


@app.command("serve")
def serve(config: Path | None = ConfigOption,
          host: str | None = typer.Option(None, "--host", help="overrides server.host"),
          port: int | None = typer.Option(None, "--port", min=0, max=65535,
                                          help="overrides server.port"),
          workers: int | None = typer.Option(None, "--workers", min=0,
                                             help="agent worker threads in this process "
                                             "(overrides server.run_workers)"),
          log_level: str = typer.Option("warning", "--log-level")) -> None:
    """Serve the gateway, the agent task API, RAG, /metrics and /dashboard."""
    import uvicorn

    from ridgeline.platform.service import Platform

    cfg = _load(config)
    server = cfg.server.model_copy(update={k: v for k, v in
                                           {"host": host, "port": port,
                                            "run_workers": workers}.items() if v is not None})
    cfg = cfg.model_copy(update={"server": server})
    platform = Platform(cfg)
    console.print(f"platform on http://{server.host}:{server.port} (dashboard: /dashboard; "
                  f"data in {cfg.data_dir}; {server.run_workers} worker threads here)",
                  highlight=False)
    try:
        uvicorn.run(platform.app(), host=server.host, port=server.port, log_level=log_level,
                    access_log=False, timeout_graceful_shutdown=5)
    finally:
        platform.close()


@app.command("worker")
def worker(config: Path | None = ConfigOption,
           concurrency: int | None = typer.Option(None, "--concurrency", min=1,
                                                  help="overrides worker.concurrency"),
           name: str | None = typer.Option(None, "--name", help="a stable name (Redis keeps "
                                           "one consumer per name)")) -> None:
    """Run agent tasks from the queue until interrupted."""
    from ridgeline.platform.service import Platform

    cfg = _load(config)
    if concurrency is not None:
        cfg = cfg.model_copy(update={"worker": cfg.worker.model_copy(
            update={"concurrency": concurrency})})
    platform = Platform(cfg)
    w = platform.worker(name)
    console.print(f"worker {w.name}: {cfg.worker.concurrency} tasks at once, queue "
                  f"{cfg.queue.backend}, sandbox {cfg.worker.sandbox}", highlight=False)
    try:
        w.run_forever()
    finally:
        platform.close()


@app.command("maintain")
def maintain(config: Path | None = ConfigOption) -> None:
    """Repair once what crashes leave (orphaned tasks, stalled graphs, dead letters)."""
    from ridgeline.platform.service import Platform

    platform = Platform(_load(config))
    try:
        print(json.dumps(platform.maintenance()))
    finally:
        platform.close()


@app.command("mcp")
def mcp(config: Path | None = ConfigOption,
        key: str = typer.Option(..., "--key", envvar="RIDGELINE_API_KEY",
                                help="the API key whose scopes decide which tools are served")
        ) -> None:
    """Serve the platform's tools to an MCP client over stdio (as the key's principal)."""
    import anyio

    from ridgeline.platform.mcp_bridge import mcp_server
    from ridgeline.platform.service import Platform

    platform = Platform(_load(config))
    try:
        principal = platform.keys.authenticate(key).principal
        server = mcp_server(platform.tools, principal)

        async def serve_stdio() -> None:
            from mcp.server.stdio import stdio_server
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        anyio.run(serve_stdio)
    finally:
        platform.close()


@keys_app.command("create")
def keys_create(config: Path | None = ConfigOption,
                tenant: str = typer.Option(..., "--tenant"),
                user: str | None = typer.Option(None, "--user"),
                name: str = typer.Option("", "--name"),
                group: list[str] = typer.Option([], "--group", help="for document ACLs"),
                scope: list[str] = typer.Option([], "--scope", help="tool scopes"),
                model: list[str] = typer.Option([], "--model", help="allowed models "
                                                "(default: all)"),
                rpm: int | None = typer.Option(None, "--rpm", min=1),
                tpm: int | None = typer.Option(None, "--tpm", min=1),
                max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1),
                admin: bool = typer.Option(False, "--admin")) -> None:
    """Create an API key; it is printed once (only its hash is stored)."""
    from ridgeline.platform.limits import KeyLimits

    with _key_store(_load(config)) as store:
        key, record = store.create(tenant, user=user, name=name, groups=group, scopes=scope,
                                   models=model or None, admin=admin,
                                   limits=KeyLimits(rpm=rpm, tpm=tpm,
                                                    max_concurrency=max_concurrency))
    console.print(f"key {record.key_id} for tenant {tenant} (shown once):", highlight=False)
    print(key)


@keys_app.command("revoke")
def keys_revoke(key_id: str, config: Path | None = ConfigOption) -> None:
    with _key_store(_load(config)) as store:
        store.revoke(key_id)
    console.print(f"revoked {key_id}", highlight=False)


@keys_app.command("list")
def keys_list(config: Path | None = ConfigOption,
              tenant: str | None = typer.Option(None, "--tenant"),
              all_keys: bool = typer.Option(False, "--all", help="revoked keys too")) -> None:
    """List keys (never their secrets)."""
    with _key_store(_load(config)) as store:
        for k in store.list(tenant=tenant, include_revoked=all_keys):
            print(json.dumps({"key_id": k.key_id, "tenant": k.tenant, "user": k.user,
                              "admin": k.admin, "revoked": k.revoked,
                              "models": sorted(k.models) if k.models is not None else None,
                              "scopes": sorted(k.scopes)}))


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="platform")

