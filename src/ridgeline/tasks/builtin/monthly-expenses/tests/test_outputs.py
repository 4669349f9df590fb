"""monthly-expenses: totals per month and category."""

import csv
from decimal import Decimal
from pathlib import Path

SRC = Path(__file__).parent / "transactions.csv"


def reference():
    totals = {}
    for r in csv.DictReader(open(SRC)):
        key = (r["date"][:7], r["category"])
        totals[key] = totals.get(key, Decimal(0)) + Decimal(r["amount"])
    return [[m, c, f"{totals[(m, c)]:.2f}"] for m, c in sorted(totals)]


def test_summary():
    rows = [r for r in csv.reader(open("/app/monthly_summary.csv")) if r]
    assert rows[0] == ["month", "category", "total"]
    assert rows[1:] == reference()


def test_reference_covers_three_months():
    assert {m for m, _, _ in reference()} == {"2024-01", "2024-02", "2024-03"}
