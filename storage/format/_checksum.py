"""The checksum algorithms of the format (docs/format.md, "Integrity"): a manifest's version fixes
its algorithm (``ALGORITHM_OF_VERSION``), so damage cannot switch a reader to another function.
Every function is ``f(data, value=0) -> int``, ``value`` the running checksum so far."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import crc32c as _crc32c

try:  # the same CRC-32 as zlib's, faster (ISA-L); optional: ``pip install isal``
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32

Checksum = Callable[[Any, int], int]

WRITTEN = "crc32c"  # the algorithm of what this code writes (format version 3)
ALGORITHM_OF_VERSION = {1: "crc32", 2: "crc32", 3: "crc32c", 4: "crc32c", 5: "crc32c"}
FUNCTIONS: dict[str, Checksum] = {"crc32": crc32, "crc32c": _crc32c.crc32c}


def checksum_function(algorithm: str) -> Checksum:
    """The function of ``algorithm`` (a name from ``FUNCTIONS``); ValueError for another."""
    try:
        return FUNCTIONS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {sorted(FUNCTIONS)}"
        ) from None
