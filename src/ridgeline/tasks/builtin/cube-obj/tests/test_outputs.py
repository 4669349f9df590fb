"""cube-obj: a closed, outward-facing unit cube centred at the origin."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import meshcheck as mc  # noqa: E402

OBJ = "/app/cube.obj"


def test_closed_and_oriented():
    verts, faces = mc.load_obj(OBJ)
    tris = mc.triangles(faces)
    assert tris, "no faces"
    assert not mc.degenerate(verts, tris), "degenerate faces"
    assert mc.closed_manifold_problems(tris) == []
    assert mc.euler_characteristic(tris) == 2


def test_volume_positive_one():
    verts, faces = mc.load_obj(OBJ)
    assert abs(mc.signed_volume(verts, mc.triangles(faces)) - 1.0) < 1e-6


def test_bounding_box():
    verts, faces = mc.load_obj(OBJ)
    lo, hi = mc.bbox(verts, mc.triangles(faces))
    assert all(abs(c + 0.5) < 1e-6 for c in lo) and all(abs(c - 0.5) < 1e-6 for c in hi)
