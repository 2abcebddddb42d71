"""loading: reading a step back into a sharded training state, at any world size."""

from ftsdp.storage._lazy import lazy_names

_MODULES = {"_load": ("LoadResult", "load")}
__all__ = ["LoadResult", "load"]
__getattr__, __dir__ = lazy_names(__name__, _MODULES)
