"""io: object access on fsspec URLs (retries, ranged reads, streaming), JSON collectives."""

from ftsdp.storage.io import _local, _s3  # noqa: F401  (Store's backends, found as its subclasses)
from ftsdp.storage.io._collectives import all_reduce_max, broadcast_json, rank_world, resolve_group
from ftsdp.storage.io._streaming import DEFAULT_MAX_MEMORY

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "all_reduce_max",
    "broadcast_json",
    "rank_world",
    "resolve_group",
]
