"""Charging a cart."""

import shop.pricing as pricing


def checkout(cart, tax_free=False):
    items = [(price, qty) for _, price, qty in cart.lines]
    total = pricing.calc_total(items, tax_rate=0.0) if tax_free else cart.total()
    return f"charged {total:.2f}"
