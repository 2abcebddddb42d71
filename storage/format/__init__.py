"""format: what a checkpoint is on disk: the manifest, safetensors objects, checksums, layout."""

from ftsdp.storage import _lazy

_MODULES = {"_manifest": ("FORMAT_VERSION", "Manifest")}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
