"""inference: full tensors in one process: a state dict, a module (also on meta), lazy reads."""

from ftsdp.storage import _lazy

_MODULES = {"_inference": ("LazyStateDict", "LoadIntoResult", "load_into", "load_state_dict")}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
