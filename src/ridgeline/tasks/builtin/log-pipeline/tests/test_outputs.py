"""log-pipeline: parse_line, aggregate, render, and the produced report."""

import importlib
import math
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, "/app")
LOG = (Path(__file__).parent / "access.log").read_text().splitlines()
SAMPLE = '203.0.113.9 - - [10/Mar/2024:13:55:36 +0000] "GET /a.html?x=1 HTTP/1.1" 200 2326 0.043'


def mod(name):
    for m in [m for m in sys.modules if m == "pipeline" or m.startswith("pipeline.")]:
        del sys.modules[m]
    return importlib.import_module(f"pipeline.{name}")


def reference_records():
    pat = re.compile(r'^(\S+) - - \[([^\]]+)\] "(\S+) (\S+) [^"]+" (\d{3}) (\d+|-) ([\d.]+)$')
    out = []
    for line in LOG:
        m = pat.match(line)
        if m:
            ip, t, method, path, status, size, dur = m.groups()
            out.append({"ip": ip, "time": t, "method": method, "path": path.split("?")[0],
                        "status": int(status), "bytes": 0 if size == "-" else int(size),
                        "duration": float(dur)})
    return out


def test_parse_line():
    rec = mod("parse").parse_line(SAMPLE)
    assert rec == {"ip": "203.0.113.9", "time": "10/Mar/2024:13:55:36 +0000",
                   "method": "GET", "path": "/a.html", "status": 200, "bytes": 2326,
                   "duration": 0.043}


@pytest.mark.parametrize("line", ["", "garbage", '1.2.3.4 - - [t] "GET /x" 200 1 0.1'])
def test_parse_line_malformed(line):
    assert mod("parse").parse_line(line) is None


def test_parse_dash_bytes():
    line = SAMPLE.replace("200 2326", "304 -")
    assert mod("parse").parse_line(line)["bytes"] == 0


def test_aggregate_small():
    recs = [{"path": p, "status": s, "bytes": b, "duration": d, "ip": "", "time": "",
             "method": "GET"} for p, s, b, d in [("/b", 200, 10, 0.5), ("/a", 404, 5, 0.1),
                                                 ("/b", 500, 0, 0.5), ("/c", 200, 1, 0.2)]]
    st = mod("aggregate").aggregate(recs)
    assert st["requests"] == 4 and st["bytes"] == 16
    assert st["status"] == {"2xx": 2, "4xx": 1, "5xx": 1}
    assert [tuple(x) for x in st["top_paths"]] == [("/b", 2), ("/a", 1), ("/c", 1)]
    assert tuple(st["slowest"]) == ("/b", 0.5)
    assert st["p95_ms"] == 500


def test_render():
    st = {"requests": 3, "bytes": 99, "status": {"4xx": 1, "2xx": 2},
          "top_paths": [("/x", 2), ("/y", 1)], "slowest": ("/y", 1.25), "p95_ms": 1250}
    assert mod("report").render(st) == ("requests: 3\nbytes: 99\n2xx: 2\n4xx: 1\n"
                                        "top: /x (2), /y (1)\nslowest: /y 1.250s\n"
                                        "p95: 1250ms\n")


def test_report_file():
    recs = reference_records()
    paths = Counter(r["path"] for r in recs)
    durs = sorted(r["duration"] for r in recs)
    slow = max(recs, key=lambda r: r["duration"])
    classes = Counter(f"{r['status'] // 100}xx" for r in recs)
    expected = [f"requests: {len(recs)}", f"bytes: {sum(r['bytes'] for r in recs)}"]
    expected += [f"{c}: {n}" for c, n in sorted(classes.items())]
    top = sorted(paths.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    expected.append("top: " + ", ".join(f"{p} ({n})" for p, n in top))
    expected.append(f"slowest: {slow['path']} {slow['duration']:.3f}s")
    expected.append(f"p95: {round(durs[math.ceil(0.95 * len(durs)) - 1] * 1000)}ms")
    expected.append("malformed: 2")
    assert Path("/app/report.txt").read_text() == "\n".join(expected) + "\n"
