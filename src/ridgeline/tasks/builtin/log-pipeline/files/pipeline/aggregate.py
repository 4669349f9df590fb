"""Statistics over parsed records."""


def aggregate(records):
    """Statistics of a list of records (dicts from parse_line), as a dict:

    requests   number of records
    bytes      sum of the bytes
    status     {status class: count}, the class being "2xx", "3xx", "4xx" or "5xx"
    top_paths  the 3 most requested paths as a list of (path, count), most requested
               first, ties broken by path
    slowest    (path, duration) of the slowest request (the first one on a tie)
    p95_ms     95th percentile of the durations in milliseconds, by nearest rank: the
               ceil(0.95 * n)-th smallest duration, times 1000, rounded to an int
    """
    raise NotImplementedError
