"""Sandbox benchmark: prints one JSON object (same code as `ridgeline sandbox bench --json`).

    .venv/bin/python benchmarks/sandbox_bench.py [--quick] [--backend bwrap] [--out FILE]
"""

from __future__ import annotations

import sys

from ridgeline.cli import main

if __name__ == "__main__":
    main(["sandbox", "bench", "--json", *sys.argv[1:]])
