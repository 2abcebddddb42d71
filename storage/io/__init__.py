"""io: object access on fsspec URLs (retries, ranged reads, streaming under a memory budget)."""

from ftsdp.storage.io._streaming import DEFAULT_MAX_MEMORY

__all__ = ["DEFAULT_MAX_MEMORY"]
