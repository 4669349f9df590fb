"""fix-flatten-recursion: flatten handles atoms and deep nesting."""

import importlib.util


def flatten(x):
    spec = importlib.util.spec_from_file_location("flatten", "/app/flatten.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.flatten(x)


def test_basic():
    assert flatten([1, [2, [3, 4]], (5, 6), []]) == [1, 2, 3, 4, 5, 6]


def test_strings_are_atoms():
    assert flatten(["ab", ["cd", ("e",)], b"xy"]) == ["ab", "cd", "e", b"xy"]


def test_dicts_are_atoms():
    d = {"k": [1, 2]}
    assert flatten([d, [d]]) == [d, d]


def test_order_kept():
    assert flatten([[3], 1, [[2], 0]]) == [3, 1, 2, 0]


def test_deep_nesting():
    deep = [7]
    for _ in range(5000):
        deep = [deep, 1]
    out = flatten(deep)
    assert out[0] == 7 and len(out) == 5001 and out[1:] == [1] * 5000


def test_tuple_input_and_empty():
    assert flatten(()) == []
    assert flatten((1, (2, (3,)))) == [1, 2, 3]
