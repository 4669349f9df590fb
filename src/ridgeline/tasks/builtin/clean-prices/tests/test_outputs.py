"""clean-prices: deduplicated (last wins), sorted, forward-filled closes."""

import csv
from pathlib import Path

SRC = Path(__file__).parent / "raw_prices.csv"


def reference():
    latest = {}
    for r in csv.DictReader(open(SRC)):
        latest[r["date"]] = r["close"].strip()
    out, prev = [], None
    for d in sorted(latest):
        v = latest[d]
        prev = prev if v in ("", "N/A") else float(v)
        out.append([d, f"{prev:.2f}"])
    return out


def test_clean_file():
    rows = [r for r in csv.reader(open("/app/clean_prices.csv")) if r]
    assert rows[0] == ["date", "close"]
    assert rows[1:] == reference()


def test_input_really_is_messy():
    dates = [r["date"] for r in csv.DictReader(open(SRC))]
    assert len(dates) > len(set(dates)) and dates != sorted(dates)
