"""The platform's configuration: one YAML file for the API server and its workers.

Every section has defaults that run on one machine with nothing else installed (one
SQLite file and an embedded Qdrant under `data_dir`); pointing `store.url` at PostgreSQL
(optionally `queue` at Redis) and `rag` at a Qdrant server scales the same code out.
Relative paths are taken relative to `data_dir`.

One database, `store.url`, holds the tasks, the webhook outbox, the job queue (backend
`sql`), the API keys and the recorded tool results. The older per-component settings
(`queue.path`, `keys.path`, `tools_path`, `tools_url`) still give a component a database
of its own, with a FutureWarning; `webhooks_url` and `webhooks_path` are refused.

    data_dir: platform-data
    store: {url: "postgresql://ridgeline:pw@db:5432/ridgeline"}   # default sqlite:///platform.db
    gateway: {upstreams: [{name: local, base_url: "http://127.0.0.1:8000/v1"}]}
    worker: {base_url: "http://127.0.0.1:8080/v1", sandbox: bwrap}
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ridgeline.config import load_config
from ridgeline.errors import NotFoundError
from ridgeline.platform.db import database_location, is_postgres_url, resolve_location
from ridgeline.platform.gateway_config import GatewayConfig
from ridgeline.platform.keys import KeyStoreConfig
from ridgeline.platform.legacy import LEGACY_FILES
from ridgeline.platform.queue import QueueConfig
from ridgeline.platform.rag import RagConfig
from ridgeline.platform.store import store_path
from ridgeline.platform.webhook_outbox import WebhookConfig
from ridgeline.platform.worker import WorkerConfig

#: The component each deprecated setting gave a database of its own, and what it holds.
_COMPONENT = {"queue.path": "queue", "keys.path": "keys", "tools_url": "tools",
              "tools_path": "tools"}
_WHAT = {"queue": "the job queue", "keys": "API keys and usage",
         "tools": "recorded tool results"}


def same_location(a: str, b: str) -> bool:
    """Whether two resolved locations name one database: the same URL, or the same SQLite
    file however its path is spelled (`:memory:` is a new database at every opening)."""
    if ":memory:" in (a, b):
        return False
    if is_postgres_url(a) or is_postgres_url(b):
        return a == b
    return os.path.realpath(a) == os.path.realpath(b)


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field("sqlite:///platform.db", description="the platform's one database: "
                     "tasks, events, checkpoints, webhook outbox, job queue (backend sql), "
                     "API keys and usage, recorded tool results. sqlite:///path (relative "
                     "to data_dir) on one machine, or postgresql://user:password@host:5432/"
                     "dbname shared by API servers and workers on many")
    pool_size: int = Field(20, ge=1, description="postgresql: connections per process at "
                           "most, shared by all of the above")

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return database_location(value) or value


class OpenAPIToolSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: str = Field(description="path or URL-less file of an OpenAPI 3 document")
    base_url: str
    scopes: list[str] | None = Field(None, description="scopes a key needs for these tools; "
                                     "default: tools:read for GET, tools:write otherwise")
    allow_private: bool = False


class ToolsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    openapi: list[OpenAPIToolSource] = Field(default_factory=list)


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    run_workers: int = Field(0, ge=0, description="agent worker threads inside the API "
                             "process (0: run `ridgeline platform worker` separately)")
    maintenance_s: float = Field(10.0, gt=0, description="how often queued tasks without a "
                                 "job, stalled graphs and dead letters are repaired")


class PlatformConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: str = "platform-data"
    server: ServerConfig = Field(default_factory=ServerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    keys: KeyStoreConfig = Field(default_factory=KeyStoreConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    rag: RagConfig = Field(default_factory=RagConfig)
    webhooks: WebhookConfig = Field(default_factory=WebhookConfig)
    tools_path: str | None = Field(None, description="deprecated: a database of their own "
                                   "for recorded tool results (they live in store.url's)")
    tools_url: str | None = Field(None, description="deprecated: as tools_path, a URL "
                                  "(sqlite:///path or postgresql://...)")
    worker: WorkerConfig = Field(default_factory=WorkerConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)

    @model_validator(mode="before")
    @classmethod
    def _outbox_in_the_store(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old in ("webhooks_url", "webhooks_path"):
                if old in data:
                    raise ValueError(
                        f"`{old}` is gone: the webhook outbox is a table in the store's "
                        f"database (store.url), written in the same transaction as a "
                        f"task's final status. Remove `{old}`; pending deliveries of an "
                        f"old data_dir/webhooks.db are moved over at start")
        return data

    @field_validator("tools_url", "tools_path")
    @classmethod
    def _check_database_urls(cls, value: str | None) -> str | None:
        return database_location(value)

    @model_validator(mode="after")
    def _deprecated_databases(self) -> PlatformConfig:
        """Each old per-component database setting still works, with a warning that
        names the one to use instead."""
        for key, value in self._separate_settings().items():
            if value is None:
                continue
            if same_location(resolve_location(value, self.data_dir), self.database()):
                then = "it names that database already: remove it"
            else:
                then = (f"remove `{key}` to move them there (data_dir/"
                        f"{LEGACY_FILES[_COMPONENT[key]]} is moved in at start, another "
                        f"database is not); until then {value!r} is used")
            warnings.warn(f"`{key}` is deprecated: the platform keeps "
                          f"{_WHAT[_COMPONENT[key]]} in its one database, `store.url`; {then}",
                          FutureWarning, stacklevel=2)
        if self.queue.backend == "sqlite":
            warnings.warn("`queue.backend: sqlite` is now called `sql`: the queue is a "
                          "table of the platform's database, `store.url` (SQLite or "
                          "PostgreSQL)", FutureWarning, stacklevel=2)
        return self

    def _separate_settings(self) -> dict[str, str | None]:
        return {"queue.path": self.queue.path if self.queue.backend != "redis" else None,
                "keys.path": self.keys.path, "tools_url": self.tools_url,
                "tools_path": self.tools_path}

    def database(self) -> str:
        """Where the one database lives (`store.url` resolved against data_dir)."""
        return store_path(self.store.url, self.data_dir)

    def separate_database(self, component: Literal["queue", "keys", "tools"]) -> str | None:
        """Where a component keeps a database of its own (a deprecated setting naming
        another database than `store.url`), resolved; None: it uses the one database."""
        settings = self._separate_settings()
        value = {"queue": settings["queue.path"], "keys": settings["keys.path"],
                 "tools": settings["tools_url"] or settings["tools_path"]}[component]
        if value is None:
            return None
        location = resolve_location(value, self.data_dir)
        return None if same_location(location, self.database()) else location

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None) -> "PlatformConfig":
        if path is None:
            return cls()
        p = Path(path)
        if not p.is_file():
            raise NotFoundError(f"platform config {p} does not exist",
                                hint="pass --config with a YAML file (see deploy/compose/"
                                "platform.yaml for one)")
        return load_config(cls, p)  # YAML and field errors name the file, line and field

    def path(self, value: str) -> str:
        """A path from the config: relative ones live under data_dir."""
        if value == ":memory:" or os.path.isabs(value):
            return value
        return str(Path(self.data_dir) / value)

    def prepare(self) -> None:
        """Create data_dir (the only directory the platform makes on its own)."""
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
