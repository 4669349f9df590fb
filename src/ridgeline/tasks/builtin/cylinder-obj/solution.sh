#!/bin/bash
cd /app
cat > make_cylinder.py <<'PY'
"""Writes cylinder.obj: N segments, two rings, a centre vertex on each cap."""
import math

N, R, H = 48, 1.0, 2.0
lines = []
for z in (0.0, H):
    for i in range(N):
        a = 2 * math.pi * i / N
        lines.append(f"v {R * math.cos(a):.9f} {R * math.sin(a):.9f} {z}")
lines.append("v 0 0 0")            # index 2N + 1: bottom centre
lines.append(f"v 0 0 {H}")         # index 2N + 2: top centre
bottom, top = 2 * N + 1, 2 * N + 2
for i in range(N):
    j = (i + 1) % N
    b0, b1, t0, t1 = i + 1, j + 1, N + i + 1, N + j + 1
    lines.append(f"f {b0} {b1} {t1} {t0}")      # side quad, outward
    lines.append(f"f {bottom} {b1} {b0}")       # bottom cap faces -z
    lines.append(f"f {top} {t0} {t1}")          # top cap faces +z
open("cylinder.obj", "w").write("\n".join(lines) + "\n")
PY
python3 make_cylinder.py
