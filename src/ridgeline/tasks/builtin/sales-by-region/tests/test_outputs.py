"""sales-by-region: totals per region with two decimals, sorted."""

import csv
from decimal import Decimal
from pathlib import Path

SRC = Path(__file__).parent / "sales.csv"


def expected():
    totals = {}
    with open(SRC, newline="") as f:
        for row in csv.DictReader(f):
            totals[row["region"]] = totals.get(row["region"], Decimal(0)) + Decimal(row["amount"])
    return [[r, f"{totals[r]:.2f}"] for r in sorted(totals)]


def rows():
    with open("/app/region_totals.csv", newline="") as f:
        return [r for r in csv.reader(f) if r]


def test_header():
    assert rows()[0] == ["region", "total"]


def test_totals():
    assert rows()[1:] == expected()
