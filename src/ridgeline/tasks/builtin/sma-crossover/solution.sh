#!/bin/bash
cd /app
python3 - <<'PY'
import csv
rows = list(csv.DictReader(open("prices.csv")))
closes = [float(r["close"]) for r in rows]
def sma(n, i):
    return sum(closes[i - n + 1:i + 1]) / n if i >= n - 1 else None
with open("signals.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["date", "signal"])
    for i in range(20, len(rows)):
        f0, s0, f1, s1 = sma(5, i - 1), sma(20, i - 1), sma(5, i), sma(20, i)
        if f1 > s1 and f0 <= s0:
            w.writerow([rows[i]["date"], "buy"])
        elif f1 < s1 and f0 >= s0:
            w.writerow([rows[i]["date"], "sell"])
PY
