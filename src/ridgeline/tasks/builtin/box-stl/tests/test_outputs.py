"""box-stl: a closed 2x3x4 box in ASCII STL with correct outward normals."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import meshcheck as mc  # noqa: E402

STL = "/app/box.stl"


def test_ascii_stl():
    text = Path(STL).read_text()
    assert text.lstrip().startswith("solid") and "endsolid" in text


def test_closed_and_oriented():
    verts, tris, _ = mc.load_stl(STL)
    assert tris and all(len(t) == 3 for t in tris)
    assert not mc.degenerate(verts, tris)
    assert mc.closed_manifold_problems(tris) == []


def test_volume_and_box():
    verts, tris, _ = mc.load_stl(STL)
    assert abs(mc.signed_volume(verts, tris) - 24.0) < 1e-6
    lo, hi = mc.bbox(verts, tris)
    assert all(abs(a - b) < 1e-6 for a, b in zip(lo, (0, 0, 0)))
    assert all(abs(a - b) < 1e-6 for a, b in zip(hi, (2, 3, 4)))


def test_facet_normals():
    verts, tris, normals = mc.load_stl(STL)
    assert len(normals) == len(tris)
    for t, n in zip(tris, normals):
        assert abs(mc.norm(n) - 1) < 1e-4, f"normal {n} is not unit length"
        geo = mc.tri_normal(verts, t)
        assert mc.dot(geo, n) / mc.norm(geo) > 0.9999, f"normal {n} disagrees with winding"
