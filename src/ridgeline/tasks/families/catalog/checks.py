"""Pieces the families' generated checks share."""

from __future__ import annotations

import hashlib


def sha256(content: str | bytes) -> str:
    """The hex SHA-256 of a file's content, as the generated tests compute it."""
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


def tree_unchanged_test(name: str, top: str) -> str:
    """Source of a pytest function `name`: the files under /app/`top` are exactly those in
    the test module's `ORIGINALS` (path relative to /app -> SHA-256). The module imports
    hashlib, os and Path."""
    return f'''def {name}():
    found = {{}}
    for dirpath, _dirs, names in os.walk("/app/{top}"):
        for n in names:
            p = Path(dirpath) / n
            found[str(p.relative_to("/app"))] = hashlib.sha256(p.read_bytes()).hexdigest()
    assert found == ORIGINALS
'''
