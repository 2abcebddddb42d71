"""conversion: checkpoints to and from other formats (hf, torch, dcp) and other world sizes."""

from ftsdp.storage import _lazy

_MODULES = {
    "_convert": ("ConvertResult", "convert", "reshard"),
    "_formats": ("FORMATS", "detect_format"),
}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
