#!/bin/bash
cd /app
python3 - <<'PY'
import csv
latest = {}
for r in csv.DictReader(open("raw_prices.csv")):
    latest[r["date"]] = r["close"].strip()
prev = None
with open("clean_prices.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["date", "close"])
    for date in sorted(latest):
        value = latest[date]
        close = prev if value in ("", "N/A") else float(value)
        w.writerow([date, f"{close:.2f}"])
        prev = close
PY
