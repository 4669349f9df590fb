#!/bin/bash
cd /app
python3 - <<'PY'
import csv
rows = list(csv.DictReader(open("prices.csv")))
with open("returns.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["date", "return"])
    for prev, cur in zip(rows, rows[1:]):
        w.writerow([cur["date"], f"{float(cur['close']) / float(prev['close']) - 1:.6f}"])
PY
