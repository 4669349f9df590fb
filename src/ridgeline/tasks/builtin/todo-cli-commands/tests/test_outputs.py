"""todo-cli-commands: done, remove, list --pending, errors; persisted."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def todo():
    db = Path(tempfile.mkdtemp()) / "todo.json"

    def run(*args):
        env = {**os.environ, "TODO_DB": str(db)}
        r = subprocess.run([sys.executable, "-m", "todo", *args], capture_output=True,
                           text=True, cwd="/app", env=env, timeout=30)
        return r.returncode, r.stdout, r.stderr

    run.db = db
    return run


def test_add_and_list_unchanged(todo):
    assert todo("add", "buy milk")[:2] == (0, "added 1\n")
    assert todo("add", "walk dog")[:2] == (0, "added 2\n")
    assert todo("list")[:2] == (0, "1. [ ] buy milk\n2. [ ] walk dog\n")


def test_done(todo):
    todo("add", "a")
    todo("add", "b")
    assert todo("done", "2")[:2] == (0, "done 2\n")
    assert todo("list")[1] == "1. [ ] a\n2. [x] b\n"
    items = json.loads(todo.db.read_text())["items"]
    assert [i["done"] for i in items] == [False, True]


def test_remove_and_ids_not_reused(todo):
    for t in ("a", "b", "c"):
        todo("add", t)
    assert todo("remove", "3")[:2] == (0, "removed 3\n")
    assert todo("add", "d")[1] == "added 4\n"
    assert todo("list")[1] == "1. [ ] a\n2. [ ] b\n4. [ ] d\n"


def test_pending(todo):
    for t in ("a", "b", "c"):
        todo("add", t)
    todo("done", "1")
    todo("done", "3")
    assert todo("list", "--pending")[1] == "2. [ ] b\n"
    assert todo("list")[1] == "1. [x] a\n2. [ ] b\n3. [x] c\n"


def test_unknown_ids(todo):
    todo("add", "a")
    before = todo.db.read_text()
    code, out, err = todo("done", "9")
    assert code == 1 and "no item 9" in err and out == ""
    code, out, err = todo("remove", "7")
    assert code == 1 and "no item 7" in err
    assert todo.db.read_text() == before
