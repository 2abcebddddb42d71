"""Peak host memory of a process, as the memory tests measure it (Linux)."""

from __future__ import annotations

import ctypes

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(nbytes: int = 65536) -> None:
    """From now on, glibc serves allocations of at least ``nbytes`` from mmap and gives them back
    to the system when freed, so the RSS follows the real allocations (glibc otherwise raises the
    threshold after the first free and keeps freed blocks for reuse, unseen). What the
    ``MALLOC_MMAP_THRESHOLD_`` variable does at a process's start, at any time: for a rank forked
    from a server that started without it. OSError where glibc refuses."""
    if ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, nbytes) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {nbytes}) failed")


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss() -> int:
    """Reset the RSS high-water mark (``VmHWM``) to the RSS now, and return it in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")
