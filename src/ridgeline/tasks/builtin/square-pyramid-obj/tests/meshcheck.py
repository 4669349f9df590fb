"""Mesh checks for the 3D tasks' tests (stdlib only): readers for OBJ, ASCII STL and
ASCII PLY, and the geometric properties the tasks require."""

import math
from pathlib import Path

EPS = 1e-6


def _weld(points, faces):
    """Merge vertices at the same position (to 1e-6) so that shared edges match."""
    index, verts, remap = {}, [], []
    for p in points:
        key = tuple(round(c / EPS) for c in p)
        if key not in index:
            index[key] = len(verts)
            verts.append(tuple(p))
        remap.append(index[key])
    return verts, [[remap[i] for i in f] for f in faces]


def load_obj(path):
    points, faces = [], []
    for raw in Path(path).read_text().splitlines():
        parts = raw.split("#", 1)[0].split()
        if not parts:
            continue
        if parts[0] == "v":
            points.append(tuple(float(x) for x in parts[1:4]))
        elif parts[0] == "f":
            face = []
            for tok in parts[1:]:
                i = int(tok.split("/")[0])
                face.append(i - 1 if i > 0 else len(points) + i)
            faces.append(face)
    return _weld(points, faces)


def load_stl(path):
    """ASCII STL: (vertices, triangles, facet normals)."""
    points, faces, normals = [], [], []
    cur = []
    for raw in Path(path).read_text().splitlines():
        parts = raw.split()
        if not parts:
            continue
        if parts[0] == "facet" and parts[1] == "normal":
            normals.append(tuple(float(x) for x in parts[2:5]))
            cur = []
        elif parts[0] == "vertex":
            points.append(tuple(float(x) for x in parts[1:4]))
            cur.append(len(points) - 1)
        elif parts[0] == "endfacet":
            faces.append(cur)
    verts, faces = _weld(points, faces)
    return verts, faces, normals


def load_ply(path):
    """ASCII PLY with a vertex element (x, y, z) and a face element (a list property)."""
    lines = Path(path).read_text().splitlines()
    assert lines[0].strip() == "ply", "not a PLY file"
    elements, i = [], 1
    while lines[i].strip() != "end_header":
        parts = lines[i].split()
        if parts[0] == "format":
            assert parts[1] == "ascii", "only ASCII PLY is accepted"
        elif parts[0] == "element":
            elements.append([parts[1], int(parts[2]), []])
        elif parts[0] == "property":
            elements[-1][2].append(parts[-1])
        i += 1
    body = [ln.split() for ln in lines[i + 1:] if ln.strip()]
    points, faces, pos = [], [], 0
    for name, count, props in elements:
        for row in body[pos:pos + count]:
            if name == "vertex":
                values = dict(zip(props, row))
                points.append((float(values["x"]), float(values["y"]), float(values["z"])))
            elif name == "face":
                n = int(row[0])
                faces.append([int(x) for x in row[1:1 + n]])
        pos += count
    return _weld(points, faces)


def triangles(faces):
    return [(f[0], f[i], f[i + 1]) for f in faces for i in range(1, len(f) - 1)]


def sub(a, b):
    return tuple(x - y for x, y in zip(a, b))


def cross(a, b):
    return (a[1] * b[2] - a[2] * b[1], a[2] * b[0] - a[0] * b[2], a[0] * b[1] - a[1] * b[0])


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def norm(a):
    return math.sqrt(dot(a, a))


def tri_normal(verts, t):
    return cross(sub(verts[t[1]], verts[t[0]]), sub(verts[t[2]], verts[t[0]]))


def closed_manifold_problems(tris):
    """Every edge shared by exactly two triangles that traverse it in opposite directions
    (a closed, consistently oriented surface). Returns a list of problems."""
    directed = {}
    for t in tris:
        for a, b in ((t[0], t[1]), (t[1], t[2]), (t[2], t[0])):
            directed[(a, b)] = directed.get((a, b), 0) + 1
    problems = []
    for (a, b), n in directed.items():
        if n > 1:
            problems.append(f"edge {a}-{b} used {n} times in the same direction")
        if directed.get((b, a), 0) != 1:
            problems.append(f"edge {a}-{b} has no opposite edge (hole or flipped face)")
    return problems


def degenerate(verts, tris):
    return [t for t in tris if norm(tri_normal(verts, t)) < 1e-9]


def signed_volume(verts, tris):
    return sum(dot(verts[a], cross(verts[b], verts[c])) for a, b, c in tris) / 6.0


def bbox(verts, tris):
    used = sorted({i for t in tris for i in t})
    pts = [verts[i] for i in used]
    return [min(p[k] for p in pts) for k in range(3)], [max(p[k] for p in pts) for k in range(3)]


def euler_characteristic(tris):
    used = {i for t in tris for i in t}
    edges = {tuple(sorted(e)) for t in tris for e in ((t[0], t[1]), (t[1], t[2]), (t[2], t[0]))}
    return len(used) - len(edges) + len(tris)
