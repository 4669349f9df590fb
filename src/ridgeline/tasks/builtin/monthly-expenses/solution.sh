#!/bin/bash
cd /app
python3 - <<'PY'
import csv
from decimal import Decimal
totals = {}
for r in csv.DictReader(open("transactions.csv")):
    key = (r["date"][:7], r["category"])
    totals[key] = totals.get(key, Decimal(0)) + Decimal(r["amount"])
with open("monthly_summary.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["month", "category", "total"])
    for (month, cat) in sorted(totals):
        w.writerow([month, cat, f"{totals[(month, cat)]:.2f}"])
PY
