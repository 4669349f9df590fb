"""sma-crossover: buy/sell signals where SMA5 crosses SMA20."""

import csv
from pathlib import Path

ROWS = list(csv.DictReader(open(Path(__file__).parent / "prices.csv")))


def reference():
    closes = [float(r["close"]) for r in ROWS]

    def sma(n, i):
        return sum(closes[i - n + 1:i + 1]) / n

    out = []
    for i in range(20, len(ROWS)):
        f0, s0, f1, s1 = sma(5, i - 1), sma(20, i - 1), sma(5, i), sma(20, i)
        if f1 > s1 and f0 <= s0:
            out.append([ROWS[i]["date"], "buy"])
        elif f1 < s1 and f0 >= s0:
            out.append([ROWS[i]["date"], "sell"])
    return out


def test_signals():
    rows = [r for r in csv.reader(open("/app/signals.csv")) if r]
    assert rows[0] == ["date", "signal"]
    assert rows[1:] == reference()


def test_reference_has_both_kinds():
    kinds = {s for _, s in reference()}
    assert kinds == {"buy", "sell"}
