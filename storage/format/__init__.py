"""format: what a checkpoint is on disk: the manifest, safetensors objects, checksums, layout."""

from ftsdp.storage.format._layout import check_step
from ftsdp.storage.format._manifest import FORMAT_VERSION, Manifest

__all__ = ["FORMAT_VERSION", "Manifest", "check_step"]
