"""portfolio-report: metrics of a daily-rebalanced portfolio, as JSON and Markdown."""

import csv
import json
import math
import statistics
from pathlib import Path

HERE = Path(__file__).parent
KEYS = ["total_return", "annualized_volatility", "sharpe", "max_drawdown", "best_day",
        "worst_day"]


def reference():
    rows = list(csv.DictReader(open(HERE / "prices.csv")))
    weights = json.loads((HERE / "weights.json").read_text())
    dates, rets = [], []
    for prev, cur in zip(rows, rows[1:]):
        dates.append(cur["date"])
        rets.append(sum(w * (float(cur[t]) / float(prev[t]) - 1) for t, w in weights.items()))
    value, peak, dd = 1.0, 1.0, 0.0
    for r in rets:
        value *= 1 + r
        peak = max(peak, value)
        dd = max(dd, (peak - value) / peak)
    sd = statistics.stdev(rets)
    return {"total_return": value - 1, "annualized_volatility": sd * math.sqrt(252),
            "sharpe": statistics.mean(rets) / sd * math.sqrt(252), "max_drawdown": dd,
            "best_day": dates[rets.index(max(rets))], "worst_day": dates[rets.index(min(rets))]}


def report():
    return json.loads(Path("/app/report.json").read_text())


def test_json_keys():
    assert set(report()) >= set(KEYS)


def test_numbers():
    got, ref = report(), reference()
    for k in ("total_return", "annualized_volatility", "sharpe", "max_drawdown"):
        assert abs(float(got[k]) - ref[k]) <= 2e-6, k


def test_best_and_worst_days():
    got, ref = report(), reference()
    assert got["best_day"] == ref["best_day"] and got["worst_day"] == ref["worst_day"]


def test_markdown_report():
    lines = Path("/app/report.md").read_text().splitlines()
    assert lines and lines[0].startswith("# ")
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines
            if ln.strip().startswith("|")]
    assert rows, "no Markdown table"
    assert [c.lower() for c in rows[0][:2]] == ["metric", "value"]
    table = {r[0].strip("`* "): r[1].strip("`* ") for r in rows[1:] if len(r) >= 2}
    got = report()
    for k in KEYS:
        assert k in table, f"{k} missing from the table"
        if isinstance(got[k], str):
            assert table[k] == got[k]
        else:
            assert abs(float(table[k]) - float(got[k])) <= 1e-6, k
