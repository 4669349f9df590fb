#!/bin/bash
cd /app
cat > pipeline/parse.py <<'PY'
"""Parsing access-log lines."""

import re

LINE = re.compile(r'^(\S+) - - \[([^\]]+)\] "(\S+) (\S+) [^"]+" (\d{3}) (\d+|-) ([\d.]+)$')


def parse_line(line):
    m = LINE.match(line.strip())
    if m is None:
        return None
    ip, time, method, path, status, size, duration = m.groups()
    return {"ip": ip, "time": time, "method": method, "path": path.split("?", 1)[0],
            "status": int(status), "bytes": 0 if size == "-" else int(size),
            "duration": float(duration)}
PY
cat > pipeline/aggregate.py <<'PY'
"""Statistics over parsed records."""

import math
from collections import Counter


def aggregate(records):
    paths = Counter(r["path"] for r in records)
    durations = sorted(r["duration"] for r in records)
    slowest = max(records, key=lambda r: r["duration"])  # max keeps the first on ties
    rank = math.ceil(0.95 * len(durations))
    return {
        "requests": len(records),
        "bytes": sum(r["bytes"] for r in records),
        "status": dict(Counter(f"{r['status'] // 100}xx" for r in records)),
        "top_paths": sorted(paths.items(), key=lambda kv: (-kv[1], kv[0]))[:3],
        "slowest": (slowest["path"], slowest["duration"]),
        "p95_ms": round(durations[rank - 1] * 1000),
    }
PY
cat > pipeline/report.py <<'PY'
"""The text report."""


def render(stats):
    lines = [f"requests: {stats['requests']}", f"bytes: {stats['bytes']}"]
    lines += [f"{cls}: {n}" for cls, n in sorted(stats["status"].items())]
    lines.append("top: " + ", ".join(f"{p} ({n})" for p, n in stats["top_paths"]))
    path, duration = stats["slowest"]
    lines.append(f"slowest: {path} {duration:.3f}s")
    lines.append(f"p95: {stats['p95_ms']}ms")
    return "\n".join(lines) + "\n"
PY
python3 -m pipeline.main access.log report.txt
