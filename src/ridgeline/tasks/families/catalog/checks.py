"""Pieces the families' generated checks share."""

from __future__ import annotations

import hashlib


def sha256(content: str | bytes) -> str:
    """The hex SHA-256 of a file's content, as the generated tests compute it."""
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


def untouched_test(path: str, content: str | bytes) -> str:
    """Source of a pytest function: the input file `path` (relative to /app) still has
    `content`. The module imports hashlib and Path."""
    return f'''

def test_input_is_untouched():
    data = Path("/app/{path}").read_bytes()
    assert hashlib.sha256(data).hexdigest() == "{sha256(content)}", "/app/{path} was changed"
'''


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
