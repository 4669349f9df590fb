"""cylinder-obj: closed outward cylinder mesh, radius 1, z from 0 to 2."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import meshcheck as mc  # noqa: E402

import math  # noqa: E402

OBJ = "/app/cylinder.obj"


def mesh():
    verts, faces = mc.load_obj(OBJ)
    return verts, mc.triangles(faces)


def test_closed_and_oriented():
    verts, tris = mesh()
    assert tris and not mc.degenerate(verts, tris)
    assert mc.closed_manifold_problems(tris) == []
    assert mc.euler_characteristic(tris) == 2


def test_volume_close_to_cylinder():
    verts, tris = mesh()
    vol = mc.signed_volume(verts, tris)
    assert vol > 0, "faces point inwards"
    assert abs(vol - 2 * math.pi) / (2 * math.pi) < 0.02


def test_bounding_box():
    verts, tris = mesh()
    lo, hi = mc.bbox(verts, tris)
    assert all(abs(a - b) < 1e-6 for a, b in zip(lo, (-1, -1, 0)))
    assert all(abs(a - b) < 1e-6 for a, b in zip(hi, (1, 1, 2)))


def test_vertices_on_surface_and_segments():
    verts, tris = mesh()
    used = [verts[i] for i in sorted({i for t in tris for i in t})]
    rim = 0
    for x, y, z in used:
        r = math.hypot(x, y)
        on_side = abs(r - 1) < 1e-6 and -1e-6 <= z <= 2 + 1e-6
        on_cap = (abs(z) < 1e-6 or abs(z - 2) < 1e-6) and r <= 1 + 1e-6
        assert on_side or on_cap, f"vertex {(x, y, z)} is not on the surface"
        rim += abs(r - 1) < 1e-6 and abs(z) < 1e-6
    assert rim >= 32, f"only {rim} segments around the axis"
