"""fix-moving-average: moving_average matches its docstring."""

import importlib.util

import pytest


def load():
    spec = importlib.util.spec_from_file_location("stats", "/app/stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docstring_example():
    assert load().moving_average([1, 2, 3, 4], 2) == [1.5, 2.5, 3.5]


def test_window_equal_to_length():
    assert load().moving_average([2, 4, 6], 3) == [4.0]


def test_window_one():
    assert load().moving_average([5, 7], 1) == [5.0, 7.0]


def test_window_too_large():
    assert load().moving_average([1, 2], 3) == []


@pytest.mark.parametrize("window", [0, -2])
def test_bad_window(window):
    with pytest.raises(ValueError):
        load().moving_average([1, 2, 3], window)


def test_mean_still_works():
    assert load().mean([1, 2, 3, 4]) == 2.5
