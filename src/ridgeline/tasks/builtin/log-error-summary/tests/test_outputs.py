"""log-error-summary: ERROR entries per component, sorted."""

import csv
import re
from collections import Counter
from pathlib import Path

LOG = (Path(__file__).parent / "app.log").read_text()


def expected():
    counts = Counter()
    for line in LOG.splitlines():
        m = re.match(r"^\S+ \S+ (\w+) \[(\w+)\]", line)
        if m and m.group(1) == "ERROR":
            counts[m.group(2)] += 1
    return [[c, str(n)] for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def test_csv_exists():
    assert Path("/app/errors_by_component.csv").is_file()


def test_header():
    rows = list(csv.reader(open("/app/errors_by_component.csv")))
    assert rows[0] == ["component", "count"]


def test_counts_and_order():
    rows = [r for r in csv.reader(open("/app/errors_by_component.csv")) if r]
    assert rows[1:] == expected()
