"""square-pyramid-obj: closed outward pyramid, base 4x4 at z=0, apex (0,0,3)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import meshcheck as mc  # noqa: E402

OBJ = "/app/pyramid.obj"


def mesh():
    verts, faces = mc.load_obj(OBJ)
    return verts, mc.triangles(faces)


def test_closed_and_oriented():
    verts, tris = mesh()
    assert tris and not mc.degenerate(verts, tris)
    assert mc.closed_manifold_problems(tris) == []
    assert mc.euler_characteristic(tris) == 2


def test_volume():
    verts, tris = mesh()
    assert abs(mc.signed_volume(verts, tris) - 16.0) < 1e-6


def test_shape():
    verts, tris = mesh()
    used = {verts[i] for t in tris for i in t}
    assert any(mc.norm(mc.sub(p, (0, 0, 3))) < 1e-6 for p in used), "no apex at (0,0,3)"
    lo, hi = mc.bbox(verts, tris)
    assert all(abs(a - b) < 1e-6 for a, b in zip(lo, (-2, -2, 0)))
    assert all(abs(a - b) < 1e-6 for a, b in zip(hi, (2, 2, 3)))
    # every vertex is on the base square or on a side edge towards the apex
    for x, y, z in used:
        scale = 1 - z / 3
        assert abs(max(abs(x), abs(y)) - 2 * scale) < 1e-6 or (z == 0 and max(abs(x), abs(y)) <= 2)
