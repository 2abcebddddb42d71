"""catalog: the steps of a root: listing, checking and comparing them, retention, deletion."""

from ftsdp.storage.catalog._checks import VerifyReport, diff, inspect_checkpoint, verify
from ftsdp.storage.catalog._gc import GcReport, collect_garbage
from ftsdp.storage.format._steps import (
    GRACE_S,
    apply_retention,
    clear_steps,
    list_steps,
    read_manifest,
)

__all__ = [
    "GRACE_S",
    "GcReport",
    "VerifyReport",
    "apply_retention",
    "clear_steps",
    "collect_garbage",
    "diff",
    "inspect_checkpoint",
    "list_steps",
    "read_manifest",
    "verify",
]
