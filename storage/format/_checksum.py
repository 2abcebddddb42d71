"""The checksum algorithms of the format: which one each manifest version uses, and its function.

A manifest's version fixes its algorithm (``ALGORITHM_OF_VERSION``); the document names it too
(``checksum.algorithm`` and the manifest checksum's ``algorithm``), and a reader refuses a name
that does not match the version, so one damaged byte cannot switch a reader to another function.

- ``crc32c`` (CRC-32C, Castagnoli; version 3 on, what is written): the ``crc32c`` package, which
  uses the CPU's CRC instruction (SSE4.2 on x86-64, the CRC extension on ARMv8): faster than a
  memory copy on this project's machines (docs/benchmarks.md), so a checksum costs about what
  reading the bytes costs. It is also the checksum object stores offer for uploads (S3's
  ``CRC32C``).
- ``crc32`` (the CRC-32 of zlib and gzip; versions 1 and 2, read only): ISA-L's implementation
  when the optional ``isal`` package is installed, else zlib's (slower).

Every function has zlib's shape: ``f(data, value=0) -> int``, ``value`` being the running
checksum of the bytes before ``data`` (so a stream is checksummed in parts).
"""

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
ALGORITHM_OF_VERSION = {1: "crc32", 2: "crc32", 3: "crc32c", 4: "crc32c"}
FUNCTIONS: dict[str, Checksum] = {"crc32": crc32, "crc32c": _crc32c.crc32c}


def checksum_function(algorithm: str) -> Checksum:
    """The function of ``algorithm`` (a name from ``FUNCTIONS``); ValueError for another."""
    try:
        return FUNCTIONS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algorithm!r}; known: {sorted(FUNCTIONS)}"
        ) from None


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C of ``data`` (any buffer), continuing from ``value``."""
    return _crc32c.crc32c(data, value)
