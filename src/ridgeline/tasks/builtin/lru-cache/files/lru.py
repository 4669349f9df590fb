"""A least-recently-used cache. Implement the class below."""


class LRUCache:
    """Holds at most `capacity` (>= 1, else ValueError) key/value pairs.

    get(key) returns the value, or None if the key is absent; a successful get makes the
    key the most recently used. put(key, value) inserts or updates the key (making it the
    most recently used); when an insert would exceed the capacity, the least recently
    used key is evicted first. len(cache) is the number of keys held, and `key in cache`
    tells whether a key is held without changing its recency.
    """

    def __init__(self, capacity):
        raise NotImplementedError

    def get(self, key):
        raise NotImplementedError

    def put(self, key, value):
        raise NotImplementedError
