"""Prices and totals."""

TAX_RATE = 0.08


def calc_total(items, tax_rate=TAX_RATE):
    """Sum of price * quantity over (price, quantity) pairs, plus tax, rounded to cents."""
    subtotal = sum(price * qty for price, qty in items)
    return round(subtotal * (1 + tax_rate), 2)
