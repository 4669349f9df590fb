#!/bin/bash
cd /app
python3 - <<'PY'
X, Y, Z = 2.0, 3.0, 4.0
v = [(x, y, z) for z in (0, Z) for y in (0, Y) for x in (0, X)]
# quads listed counter-clockwise seen from outside
quads = [(0, 2, 3, 1), (4, 5, 7, 6), (0, 1, 5, 4), (1, 3, 7, 5), (3, 2, 6, 7), (2, 0, 4, 6)]
def sub(a, b): return [p - q for p, q in zip(a, b)]
def cross(a, b): return [a[1]*b[2]-a[2]*b[1], a[2]*b[0]-a[0]*b[2], a[0]*b[1]-a[1]*b[0]]
with open("box.stl", "w") as f:
    f.write("solid box\n")
    for a, b, c, d in quads:
        for tri in ((a, b, c), (a, c, d)):
            p = [v[i] for i in tri]
            n = cross(sub(p[1], p[0]), sub(p[2], p[0]))
            length = sum(x * x for x in n) ** 0.5
            n = [x / length for x in n]
            f.write(f"  facet normal {n[0]:g} {n[1]:g} {n[2]:g}\n    outer loop\n")
            for q in p:
                f.write(f"      vertex {q[0]:g} {q[1]:g} {q[2]:g}\n")
            f.write("    endloop\n  endfacet\n")
    f.write("endsolid box\n")
PY
