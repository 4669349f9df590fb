"""The platform's configuration: one YAML file for the API server and its workers.

Every section has defaults that run on one machine with nothing else installed (SQLite
files and an embedded Qdrant under `data_dir`); pointing `store` (and `tools_url`,
`keys.path`) at PostgreSQL, `queue` at Redis and `rag` at a Qdrant server
scales the same code out. Relative paths are taken relative to `data_dir`.

    data_dir: platform-data
    gateway: {upstreams: [{name: local, base_url: "http://127.0.0.1:8000/v1"}]}
    worker: {base_url: "http://127.0.0.1:8080/v1", sandbox: bwrap}
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ridgeline.config import load_config
from ridgeline.errors import NotFoundError
from ridgeline.platform.db import database_location
from ridgeline.platform.gateway import GatewayConfig
from ridgeline.platform.keys import KeyStoreConfig
from ridgeline.platform.queue import QueueConfig
from ridgeline.platform.rag import RagConfig
from ridgeline.platform.webhooks import WebhookConfig
from ridgeline.platform.worker import WorkerConfig


class StoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field("sqlite:///platform.db", description="the task store (tasks, events, "
                     "checkpoints): sqlite:///path (relative to data_dir) on one machine, or "
                     "postgresql://user:password@host:5432/dbname shared by API servers and "
                     "workers on many")

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
    keys: KeyStoreConfig = Field(default_factory=lambda: KeyStoreConfig(path="keys.db"))
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    rag: RagConfig = Field(default_factory=RagConfig)
    webhooks: WebhookConfig = Field(default_factory=WebhookConfig)
    tools_path: str = Field("tools.db", description="recorded results of side-effect tools")
    tools_url: str | None = Field(None, description="those results as a URL, overriding "
                                  "tools_path: sqlite:///path or postgresql://... (it may "
                                  "share the store's database)")
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

    @field_validator("tools_url")
    @classmethod
    def _check_database_urls(cls, value: str | None) -> str | None:
        return database_location(value)

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
