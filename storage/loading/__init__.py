"""loading: reading a step back into a sharded training state, at any world size."""

from ftsdp.storage.loading._load import LoadResult, load

__all__ = ["LoadResult", "load"]
