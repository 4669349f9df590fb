import pytest

from inventory import Inventory


def test_add_and_count():
    inv = Inventory()
    inv.add("apple", 3)
    inv.add("apple", 2)
    assert inv.count("apple") == 5


def test_remove_too_many():
    inv = Inventory()
    inv.add("pear", 2)
    with pytest.raises(ValueError):
        inv.remove("pear", 3)


def test_item_removed_when_empty():
    inv = Inventory()
    inv.add("plum", 1)
    inv.remove("plum", 1)
    assert inv.items() == []


def test_total_units():
    inv = Inventory()
    inv.add("a", 2)
    inv.add("b", 3)
    inv.remove("a", 1)
    assert inv.total_units() == 4
