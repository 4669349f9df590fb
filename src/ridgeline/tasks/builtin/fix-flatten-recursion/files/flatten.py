"""Flattening nested data."""


def flatten(items):
    """Flatten arbitrarily nested lists and tuples into one flat list, keeping order.

    Strings, bytes and dicts are atoms: they are kept whole, not iterated. Nesting may be
    very deep (thousands of levels). `items` itself is a list or tuple.
    """
    out = []
    for item in items:
        if hasattr(item, "__iter__"):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out
