#!/bin/bash
cd /app
python3 - <<'PY'
import csv, json
rows = list(csv.DictReader(open("prices.csv")))
peak, peak_date = None, None
best = (0.0, None, None)
for r in rows:
    c = float(r["close"])
    if peak is None or c > peak:
        peak, peak_date = c, r["date"]
    dd = (peak - c) / peak
    if dd > best[0]:
        best = (dd, peak_date, r["date"])
json.dump({"max_drawdown": round(best[0], 4), "peak_date": best[1], "trough_date": best[2]},
          open("drawdown.json", "w"), indent=2)
PY
