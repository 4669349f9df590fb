#!/bin/bash
cd /app
python3 - <<'PY'
import csv
from decimal import Decimal
totals = {}
with open("sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] = totals.get(row["region"], Decimal(0)) + Decimal(row["amount"])
with open("region_totals.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["region", "total"])
    for region in sorted(totals):
        w.writerow([region, f"{totals[region]:.2f}"])
PY
