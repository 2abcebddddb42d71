"""io: object access on fsspec URLs (retries, ranged reads, streaming under a memory budget)."""

from ftsdp.storage import _lazy

_MODULES = {"_streaming": ("DEFAULT_MAX_MEMORY",)}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
