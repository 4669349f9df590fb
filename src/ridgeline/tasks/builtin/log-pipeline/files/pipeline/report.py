"""The text report."""


def render(stats):
    """The report for `stats` (from aggregate), exactly in this format, one item per
    line and a final newline (status classes in sorted order, only those present):

    requests: 12
    bytes: 45678
    2xx: 9
    4xx: 2
    5xx: 1
    top: /a (5), /b (3), /c (2)
    slowest: /report 1.250s
    p95: 980ms
    """
    raise NotImplementedError
