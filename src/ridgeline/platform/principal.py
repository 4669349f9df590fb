"""Who is calling: the identity the gateway derives from an API key. Every platform
component takes a `Principal` (never a tenant name from the request body), so tenancy,
tool scopes and document ACLs are decided by the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Principal:
    key_id: str                      # the API key's public id (never the secret)
    tenant: str                      # isolation boundary: tasks, documents, usage
    user: str | None = None          # the person or service inside the tenant
    groups: frozenset[str] = field(default_factory=frozenset)   # for document ACLs
    scopes: frozenset[str] = field(default_factory=frozenset)   # tool permission scopes
    models: frozenset[str] | None = None  # allowed models (base names); None: all
    admin: bool = False              # may manage keys and see every tenant's tasks

    def may_use_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def has_scope(self, scope: str) -> bool:
        return self.admin or "*" in self.scopes or scope in self.scopes
