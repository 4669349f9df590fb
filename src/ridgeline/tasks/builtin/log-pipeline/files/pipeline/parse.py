"""Parsing access-log lines.

A line looks like this (client IP, two dashes, [time], "METHOD PATH PROTOCOL", status,
bytes sent or "-" for none, response time in seconds):

    203.0.113.9 - - [10/Mar/2024:13:55:36 +0000] "GET /index.html HTTP/1.1" 200 2326 0.043
"""


def parse_line(line):
    """The line as a dict with the keys ip (str), time (str, the text inside the
    brackets), method (str), path (str, without any query string: "/a?b=1" -> "/a"),
    status (int), bytes (int, 0 for "-") and duration (float, seconds); or None when the
    line does not have this format (blank lines included)."""
    raise NotImplementedError
