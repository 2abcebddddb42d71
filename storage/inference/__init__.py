"""inference: full tensors in one process: a state dict, a module (also on meta), lazy reads."""

from ftsdp.storage._lazy import lazy_names

_MODULES = {"_inference": ("LazyStateDict", "LoadIntoResult", "load_into", "load_state_dict")}
__all__ = ["LazyStateDict", "LoadIntoResult", "load_into", "load_state_dict"]
__getattr__, __dir__ = lazy_names(__name__, _MODULES)
