"""daily-returns: simple returns from closes, rounded to 6 decimals."""

import csv
from pathlib import Path

PRICES = list(csv.DictReader(open(Path(__file__).parent / "prices.csv")))


def test_returns():
    rows = list(csv.reader(open("/app/returns.csv")))
    assert rows[0] == ["date", "return"]
    body = [r for r in rows[1:] if r]
    assert [r[0] for r in body] == [p["date"] for p in PRICES[1:]]
    for (date, value), prev, cur in zip(body, PRICES, PRICES[1:]):
        expected = float(cur["close"]) / float(prev["close"]) - 1
        assert abs(float(value) - expected) <= 6e-7, date
        assert len(value.split(".")[-1]) <= 6, f"{date}: not rounded to 6 decimals"
