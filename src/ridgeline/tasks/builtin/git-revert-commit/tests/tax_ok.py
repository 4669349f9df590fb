RATE = 0.2


def with_tax(amount):
    return round(amount * (1 + RATE), 2)
