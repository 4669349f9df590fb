"""The process's resident memory, for every train step's metrics, and handing freed heap
memory back to the OS.

A train step allocates and frees a few GB of activations whose shapes change with every
batch (the sequence lengths vary), on torch's threads as well as the caller's. glibc's
malloc keeps freed chunks in per-thread arenas and returns memory to the OS only from the
top of the main heap (and in whole mmap'd chunks above its dynamic threshold), so the
process's RSS can ratchet up step after step without any live tensor growing.
`release_freed_memory()` (glibc's `malloc_trim(0)`: every arena, every free page) after a
step gives that memory back; elsewhere (macOS, musl) it does nothing.

    rss_gb()          VmRSS now, GB (1e9 bytes)
    peak_rss_gb()     VmHWM, the high-water mark of RSS, GB
    memory_metrics()  {"memory/rss_gb": .., "memory/peak_rss_gb": ..} (what is known)
"""

from __future__ import annotations

import ctypes
import functools
import resource
import sys
from collections.abc import Callable

_GB = 1e9


def _status_kb(field: str) -> int | None:
    """A `kB` field of /proc/self/status (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_gb() -> float | None:
    """The resident set size now, GB; None where /proc is not there."""
    kb = _status_kb("VmRSS")
    return kb * 1024 / _GB if kb is not None else None


def peak_rss_gb() -> float | None:
    """The largest resident set size the process has had, GB: VmHWM, or getrusage's
    ru_maxrss (KB on Linux, bytes on macOS)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024 / _GB
    try:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError):
        return None
    return peak / _GB if sys.platform == "darwin" else peak * 1024 / _GB


def memory_metrics() -> dict[str, float]:
    """`memory/rss_gb` and `memory/peak_rss_gb`, those this platform can tell."""
    out = {}
    for key, value in (("memory/rss_gb", rss_gb()), ("memory/peak_rss_gb", peak_rss_gb())):
        if value is not None:
            out[key] = round(value, 4)
    return out


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another libc, no libc to load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


#: glibc's mallopt parameter for the mmap threshold (malloc.h M_MMAP_THRESHOLD).
_M_MMAP_THRESHOLD = -3


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """Serve every allocation of `threshold` bytes or more with its own mmap (glibc
    `mallopt(M_MMAP_THRESHOLD)`), so a freed activation goes back to the OS at once. By
    default glibc raises this threshold (up to 32 MB) each time a large chunk is freed,
    after which a train step's tensors land in the heap, where they fragment and
    `malloc_trim` cannot give all of them back. Process-wide; True when set. A no-op
    returning False without glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`, which trims
    every arena, not only the top of the main heap); True when some memory was
    released. A no-op returning False without glibc. It takes a few milliseconds after
    a train step; memory in use is untouched."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
