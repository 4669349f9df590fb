"""Small statistics helpers used by the dashboard."""


def moving_average(values, window):
    """Simple moving averages of `values` over `window` consecutive items.

    Returns one average per full window, in order: for values [1, 2, 3, 4] and window 2
    the result is [1.5, 2.5, 3.5]. A window larger than the data gives []. A window
    smaller than 1 raises ValueError.
    """
    result = []
    for i in range(len(values) - window):
        chunk = values[i:i + window]
        result.append(sum(chunk) / window)
    return result


def mean(values):
    """Arithmetic mean; ValueError for no values."""
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)
