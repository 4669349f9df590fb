"""json-to-csv: users.csv rows sorted by id with proper quoting."""

import csv
import json
from pathlib import Path

USERS = sorted(json.loads((Path(__file__).parent / "users.json").read_text()),
               key=lambda u: u["id"])


def rows():
    with open("/app/users.csv", newline="") as f:
        return [r for r in csv.reader(f) if r]


def test_header():
    assert rows()[0] == ["id", "name", "email", "city"]


def test_rows():
    assert rows()[1:] == [[str(u["id"]), u["name"], u["email"], u["address"]["city"]]
                          for u in USERS]
