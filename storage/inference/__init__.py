"""inference: full tensors in one process: a state dict, a module (also on meta), lazy reads."""

from ftsdp.storage.inference._inference import (
    LazyStateDict,
    LoadIntoResult,
    load_into,
    load_state_dict,
)

__all__ = ["LazyStateDict", "LoadIntoResult", "load_into", "load_state_dict"]
