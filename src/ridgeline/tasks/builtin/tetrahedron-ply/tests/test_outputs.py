"""tetrahedron-ply: a regular tetrahedron, edge 2, centred, outward faces."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import meshcheck as mc  # noqa: E402

import itertools  # noqa: E402
import math  # noqa: E402

PLY = "/app/tetrahedron.ply"


def test_four_vertices_four_triangles():
    verts, faces = mc.load_ply(PLY)
    assert len(verts) == 4 and len(faces) == 4 and all(len(f) == 3 for f in faces)


def test_edges_length_two():
    verts, _ = mc.load_ply(PLY)
    for a, b in itertools.combinations(verts, 2):
        assert abs(mc.norm(mc.sub(a, b)) - 2.0) < 1e-5


def test_centroid_at_origin():
    verts, _ = mc.load_ply(PLY)
    assert all(abs(sum(v[k] for v in verts) / 4) < 1e-5 for k in range(3))


def test_closed_outward():
    verts, faces = mc.load_ply(PLY)
    tris = mc.triangles(faces)
    assert mc.closed_manifold_problems(tris) == []
    assert abs(mc.signed_volume(verts, tris) - 8 / (6 * math.sqrt(2))) < 1e-5
