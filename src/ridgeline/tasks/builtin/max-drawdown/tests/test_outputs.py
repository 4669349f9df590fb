"""max-drawdown: largest peak-to-trough decline with its dates."""

import csv
import json
from pathlib import Path

PRICES = list(csv.DictReader(open(Path(__file__).parent / "prices.csv")))


def reference():
    peak, peak_date, best = None, None, (0.0, None, None)
    for r in PRICES:
        c = float(r["close"])
        if peak is None or c > peak:
            peak, peak_date = c, r["date"]
        if (peak - c) / peak > best[0]:
            best = ((peak - c) / peak, peak_date, r["date"])
    return best


def test_drawdown_json():
    data = json.loads(Path("/app/drawdown.json").read_text())
    dd, peak_date, trough_date = reference()
    assert abs(float(data["max_drawdown"]) - dd) <= 6e-5
    assert data["peak_date"] == peak_date
    assert data["trough_date"] == trough_date


def test_is_a_positive_fraction():
    data = json.loads(Path("/app/drawdown.json").read_text())
    assert 0 < float(data["max_drawdown"]) < 1
