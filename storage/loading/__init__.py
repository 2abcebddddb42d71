"""loading: reading a step back into a sharded training state, at any world size."""

from ftsdp.storage import _lazy

_MODULES = {"_load": ("LoadResult", "load")}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
