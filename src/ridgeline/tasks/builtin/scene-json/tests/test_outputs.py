"""scene-json: a room scene that satisfies the layout constraints."""

import itertools
import json
import math
from pathlib import Path

EPS = 1e-9


def scene():
    return json.loads(Path("/app/scene.json").read_text())


def boxes():
    return {o["name"]: o for o in scene()["objects"]}


def extent(o):
    (sx, sy, sz), (x, y, z) = o["size"], o["position"]
    return [(x - sx / 2, x + sx / 2), (y - sy / 2, y + sy / 2), (z - sz / 2, z + sz / 2)]


def test_three_named_boxes():
    objs = scene()["objects"]
    assert sorted(o["name"] for o in objs) == ["chair", "lamp", "table"]
    for o in objs:
        assert o["type"] == "box" and len(o["size"]) == 3 and len(o["position"]) == 3
        assert all(s > 0 for s in o["size"])


def test_table_size():
    assert [float(s) for s in boxes()["table"]["size"]] == [2.0, 1.0, 0.8]


def test_on_floor_inside_room():
    for o in boxes().values():
        (x0, x1), (y0, y1), (z0, _) = extent(o)
        assert abs(z0) < 1e-6, f"{o['name']} does not rest on the floor"
        assert x0 >= -EPS and y0 >= -EPS and x1 <= 10 + EPS and y1 <= 10 + EPS


def test_no_overlap():
    for a, b in itertools.combinations(boxes().values(), 2):
        overlap = all(min(p[1], q[1]) - max(p[0], q[0]) > 1e-9
                      for p, q in zip(extent(a), extent(b)))
        assert not overlap, f"{a['name']} overlaps {b['name']}"


def test_lamp_tallest_and_chair_near_table():
    b = boxes()
    assert b["lamp"]["size"][2] > max(b["table"]["size"][2], b["chair"]["size"][2])
    (tx, ty, _), (cx, cy, _) = b["table"]["position"], b["chair"]["position"]
    assert math.hypot(tx - cx, ty - cy) <= 1.5 + EPS


def test_camera():
    cam = scene()["camera"]
    x, y, z = cam["position"]
    assert 0 <= x <= 10 and 0 <= y <= 10 and 1.5 <= z <= 2
    assert [float(v) for v in cam["look_at"]] == [float(v) for v in boxes()["table"]["position"]]


def test_light_above_everything():
    top = max(e[2][1] for e in map(extent, boxes().values()))
    lights = [lt for lt in scene()["lights"] if lt["type"] == "point"]
    assert lights and all(lt["intensity"] > 0 for lt in lights)
    assert any(lt["position"][2] > top for lt in lights)
