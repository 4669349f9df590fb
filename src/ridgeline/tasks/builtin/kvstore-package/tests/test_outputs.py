"""kvstore-package: the Store API and the command line from SPEC.md."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, "/app")


def store_cls():
    for name in [m for m in sys.modules if m == "kvstore" or m.startswith("kvstore.")]:
        del sys.modules[name]
    from kvstore import Store
    return Store


@pytest.fixture
def db():
    return Path(tempfile.mkdtemp()) / "store.json"


def cli(db, *args):
    r = subprocess.run([sys.executable, "-m", "kvstore", "--db", str(db), *args],
                       capture_output=True, text=True, cwd="/app", timeout=30)
    return r.returncode, r.stdout, r.stderr


def test_set_get_delete(db):
    s = store_cls()(db)
    assert s.get("a") is None and s.get("a", 5) == 5
    s.set("a", {"x": [1, 2]})
    s.set("b", "text")
    assert s.get("a") == {"x": [1, 2]} and len(s) == 2 and "b" in s
    assert s.delete("a") is True and s.delete("a") is False
    assert s.keys() == ["b"]


def test_key_validation(db):
    s = store_cls()(db)
    with pytest.raises(TypeError):
        s.set(1, "x")
    with pytest.raises(ValueError):
        s.set("", "x")


def test_file_format_and_persistence(db):
    Store = store_cls()
    Store(db).set("k", [1, "two"])
    assert json.loads(db.read_text()) == {"k": [1, "two"]}
    assert Store(db).get("k") == [1, "two"]


def test_two_stores_share_state(db):
    Store = store_cls()
    a, b = Store(db), Store(db)
    a.set("x", 1)
    assert b.get("x") == 1
    b.delete("x")
    assert "x" not in a


def test_missing_file_is_empty(db):
    s = store_cls()(db)
    assert s.keys() == [] and len(s) == 0 and not db.exists()


def test_atomic_write_uses_replace(db, monkeypatch):
    Store = store_cls()
    calls = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append((a, b)), real(a, b)))
    Store(db).set("k", 1)
    assert calls and Path(calls[0][1]) == db and Path(calls[0][0]).parent == db.parent
    assert sorted(p.name for p in db.parent.iterdir()) == ["store.json"]


def test_cli(db):
    assert cli(db, "set", "n", "42") == (0, "", "")
    assert cli(db, "set", "name", "hello world")[0] == 0
    assert cli(db, "set", "obj", '{"a": [1, 2]}')[0] == 0
    assert cli(db, "get", "n")[:2] == (0, "42\n")
    assert cli(db, "get", "name")[:2] == (0, '"hello world"\n')
    assert cli(db, "get", "obj")[:2] == (0, '{"a": [1, 2]}\n')
    assert cli(db, "keys")[:2] == (0, "n\nname\nobj\n")
    assert cli(db, "delete", "n")[0] == 0
    code, out, err = cli(db, "get", "n")
    assert code == 1 and "missing key: n" in err
    assert cli(db, "delete", "n")[0] == 1
    assert store_cls()(db).get("obj") == {"a": [1, 2]}
