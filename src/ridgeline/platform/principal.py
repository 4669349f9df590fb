"""Who is calling: the identity the gateway derives from an API key. Every platform
component takes a `Principal` (never a tenant name from the request body), so tenancy,
tool scopes and document ACLs are decided by the server."""

from __future__ import annotations

from dataclasses import dataclass, field

from ridgeline.errors import PermissionDeniedError


class MissingScopeError(PermissionDeniedError):
    """The caller's key lacks the scope a route needs (403)."""

    code = "insufficient_scope"


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

    def require(self, scope: str, what: str) -> Principal:
        """This principal, if it has `scope` (for `what`, named in the error)."""
        if not self.has_scope(scope):
            raise MissingScopeError(f"this API key may not {what}: it needs the scope "
                                    f"{scope!r}", hint="ask an administrator for a key with "
                                    "that scope")
        return self

    def reader_ids(self) -> frozenset[str]:
        """The names under which this caller may have been granted a task: its key, its
        user and its groups (a task's readers are stored as the same strings)."""
        ids = {key_reader(self.key_id)}
        if self.user:
            ids.add(user_reader(self.user))
        ids.update(group_reader(g) for g in self.groups)
        return frozenset(ids)


# Grants are prefixed so that a user and a group (or a key id) with the same name never
# match each other.
def key_reader(key_id: str) -> str:
    return f"key:{key_id}"


def user_reader(user: str) -> str:
    return f"user:{user}"


def group_reader(group: str) -> str:
    return f"group:{group}"
