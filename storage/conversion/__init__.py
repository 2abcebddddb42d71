"""conversion: checkpoints to and from other formats (hf, torch, dcp) and other world sizes."""

from ftsdp.storage.conversion._convert import ConvertResult, convert, reshard, training_layout
from ftsdp.storage.conversion._formats import FORMATS, detect_format

__all__ = ["FORMATS", "ConvertResult", "convert", "detect_format", "reshard", "training_layout"]
