#!/bin/bash
mkdir -p /app/kvstore
cat > /app/kvstore/__init__.py <<'PY'
"""A persistent key-value store (see SPEC.md)."""

from kvstore.store import Store

__all__ = ["Store"]
PY
cat > /app/kvstore/store.py <<'PY'
"""Store: a JSON file of key -> value, re-read on every operation, written atomically."""

import json
import os
import tempfile
from pathlib import Path


class Store:
    def __init__(self, path):
        self.path = Path(path)

    def _read(self):
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def _write(self, data):
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def set(self, key, value):
        if not isinstance(key, str):
            raise TypeError("keys must be strings")
        if not key:
            raise ValueError("keys must not be empty")
        data = self._read()
        data[key] = value
        self._write(data)

    def get(self, key, default=None):
        return self._read().get(key, default)

    def delete(self, key):
        data = self._read()
        if key not in data:
            return False
        del data[key]
        self._write(data)
        return True

    def keys(self):
        return sorted(self._read())

    def __len__(self):
        return len(self._read())

    def __contains__(self, key):
        return key in self._read()
PY
cat > /app/kvstore/cli.py <<'PY'
"""python3 -m kvstore --db PATH set|get|delete|keys ..."""

import argparse
import json
import sys

from kvstore.store import Store


def main(argv=None):
    p = argparse.ArgumentParser(prog="kvstore")
    p.add_argument("--db", required=True)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("set")
    s.add_argument("key")
    s.add_argument("value")
    sub.add_parser("get").add_argument("key")
    sub.add_parser("delete").add_argument("key")
    sub.add_parser("keys")
    a = p.parse_args(argv)
    store = Store(a.db)
    if a.command == "set":
        try:
            value = json.loads(a.value)
        except json.JSONDecodeError:
            value = a.value
        store.set(a.key, value)
    elif a.command == "get":
        missing = object()
        value = store.get(a.key, missing)
        if value is missing:
            print(f"missing key: {a.key}", file=sys.stderr)
            return 1
        print(json.dumps(value))
    elif a.command == "delete":
        if not store.delete(a.key):
            print(f"missing key: {a.key}", file=sys.stderr)
            return 1
    else:
        for k in store.keys():
            print(k)
    return 0
PY
cat > /app/kvstore/__main__.py <<'PY'
import sys

from kvstore.cli import main

sys.exit(main())
PY
