"""lru-cache: LRUCache semantics."""

import importlib.util

import pytest


def cache(n):
    spec = importlib.util.spec_from_file_location("lru", "/app/lru.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LRUCache(n)


def test_get_put():
    c = cache(2)
    c.put("a", 1)
    assert c.get("a") == 1
    assert c.get("missing") is None


def test_eviction_order():
    c = cache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.get("a")            # b is now least recently used
    c.put("c", 3)
    assert "b" not in c and c.get("a") == 1 and c.get("c") == 3


def test_update_refreshes():
    c = cache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("a", 10)        # update: a most recent
    c.put("c", 3)
    assert c.get("a") == 10 and "b" not in c
    assert len(c) == 2


def test_contains_does_not_refresh():
    c = cache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert "a" in c
    c.put("c", 3)         # a is still least recent
    assert "a" not in c and "b" in c


def test_capacity_one_and_invalid():
    c = cache(1)
    c.put(1, "x")
    c.put(2, "y")
    assert len(c) == 1 and c.get(2) == "y" and c.get(1) is None
    with pytest.raises(ValueError):
        cache(0)


def test_many_operations():
    c = cache(100)
    for i in range(1000):
        c.put(i, i * i)
    assert len(c) == 100
    assert all(c.get(i) == i * i for i in range(900, 1000))
    assert c.get(899) is None
