#!/bin/bash
cat > /app/wc.py <<'PY'
import argparse
import sys


def counts(data):
    return [data.count(b"\n"), len(data.split()), len(data)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-l", action="store_true")
    p.add_argument("-w", action="store_true")
    p.add_argument("-c", action="store_true")
    p.add_argument("files", nargs="+")
    a = p.parse_args()
    show = [a.l, a.w, a.c]
    if not any(show):
        show = [True, True, True]
    total = [0, 0, 0]
    status = 0
    for name in a.files:
        try:
            with open(name, "rb") as f:
                c = counts(f.read())
        except OSError as e:
            print(f"wc.py: {name}: {e.strerror}", file=sys.stderr)
            status = 1
            continue
        total = [x + y for x, y in zip(total, c)]
        print(" ".join(str(v) for v, s in zip(c, show) if s), name)
    if len(a.files) > 1:
        print(" ".join(str(v) for v, s in zip(total, show) if s), "total")
    return status


if __name__ == "__main__":
    sys.exit(main())
PY
