"""Persistence: the list lives in a JSON file, $TODO_DB (default ./todo.json)."""

import json
import os
from pathlib import Path


def db_path():
    return Path(os.environ.get("TODO_DB", "todo.json"))


def load():
    p = db_path()
    if not p.exists():
        return {"next_id": 1, "items": []}
    return json.loads(p.read_text())


def save(data):
    db_path().write_text(json.dumps(data, indent=2))
