#!/bin/bash
cd /app
cat > portfolio.py <<'PY'
"""Daily-rebalanced portfolio metrics from prices.csv and weights.json."""

import csv
import json
import math
import statistics

rows = list(csv.DictReader(open("prices.csv")))
weights = json.load(open("weights.json"))
dates, returns = [], []
for prev, cur in zip(rows, rows[1:]):
    r = sum(w * (float(cur[t]) / float(prev[t]) - 1) for t, w in weights.items())
    dates.append(cur["date"])
    returns.append(r)

value, peak, max_dd, growth = 1.0, 1.0, 0.0, 1.0
for r in returns:
    value *= 1 + r
    peak = max(peak, value)
    max_dd = max(max_dd, (peak - value) / peak)
std = statistics.stdev(returns)
report = {
    "total_return": round(value - 1, 6),
    "annualized_volatility": round(std * math.sqrt(252), 6),
    "sharpe": round(statistics.mean(returns) / std * math.sqrt(252), 6),
    "max_drawdown": round(max_dd, 6),
    "best_day": dates[returns.index(max(returns))],
    "worst_day": dates[returns.index(min(returns))],
}
json.dump(report, open("report.json", "w"), indent=2)
with open("report.md", "w") as f:
    f.write("# Portfolio report\n\n")
    f.write(f"Daily-rebalanced portfolio over {len(returns)} trading days.\n\n")
    f.write("| metric | value |\n|---|---|\n")
    for k, v in report.items():
        f.write(f"| {k} | {v} |\n")
PY
python3 portfolio.py
