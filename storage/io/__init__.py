"""io: object access on fsspec URLs (retries, ranged reads, streaming under a memory budget)."""

from ftsdp.storage.io import _local, _s3  # noqa: F401  (Store's backends, found as its subclasses)
from ftsdp.storage.io._streaming import DEFAULT_MAX_MEMORY

__all__ = ["DEFAULT_MAX_MEMORY"]
