#!/bin/bash
cd /app
python3 - <<'PY'
import math
s = 2 / (2 * math.sqrt(2))          # (+-1,+-1,+-1) corners have edge 2*sqrt(2)
v = [(s, s, s), (s, -s, -s), (-s, s, -s), (-s, -s, s)]
faces = [(0, 1, 2), (0, 3, 1), (0, 2, 3), (1, 3, 2)]
def sub(a, b): return [p - q for p, q in zip(a, b)]
def cross(a, b): return [a[1]*b[2]-a[2]*b[1], a[2]*b[0]-a[0]*b[2], a[0]*b[1]-a[1]*b[0]]
oriented = []
for f in faces:
    n = cross(sub(v[f[1]], v[f[0]]), sub(v[f[2]], v[f[0]]))
    centre = [sum(v[i][k] for i in f) / 3 for k in range(3)]
    oriented.append(f if sum(a * b for a, b in zip(n, centre)) > 0 else (f[0], f[2], f[1]))
with open("tetrahedron.ply", "w") as out:
    out.write("ply\nformat ascii 1.0\nelement vertex 4\nproperty float x\nproperty float y\n"
              "property float z\nelement face 4\nproperty list uchar int vertex_indices\n"
              "end_header\n")
    for p in v:
        out.write(f"{p[0]:.9f} {p[1]:.9f} {p[2]:.9f}\n")
    for f in oriented:
        out.write(f"3 {f[0]} {f[1]} {f[2]}\n")
PY
