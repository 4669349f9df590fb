"""A shopping cart."""

from shop.pricing import calc_total


class Cart:
    def __init__(self):
        self.lines = []

    def add(self, name, price, qty=1):
        self.lines.append((name, price, qty))

    def total(self):
        return calc_total([(price, qty) for _, price, qty in self.lines])
