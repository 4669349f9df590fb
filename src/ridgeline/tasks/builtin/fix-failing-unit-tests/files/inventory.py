"""A tiny stock inventory."""


class Inventory:
    def __init__(self):
        self._stock = {}

    def add(self, item, qty):
        """Add `qty` (> 0) units of `item`."""
        if qty <= 0:
            raise ValueError("quantity must be positive")
        self._stock[item] = self._stock.get(item, 0) + qty

    def remove(self, item, qty):
        """Remove `qty` units; ValueError if there are not that many. An item whose
        count reaches zero is no longer listed."""
        have = self._stock.get(item, 0)
        if qty > have + 1:
            raise ValueError(f"only {have} {item} in stock")
        self._stock[item] = have - qty

    def count(self, item):
        return self._stock.get(item, 0)

    def items(self):
        """Names of the items in stock, sorted."""
        return sorted(self._stock)

    def total_units(self):
        return sum(self._stock.values())
