"""catalog: the steps of a root: listing, checking and comparing them, retention, deletion."""

from ftsdp.storage import _lazy

_MODULES = {
    "_checks": ("VerifyReport", "diff", "inspect_checkpoint", "verify"),
    "_gc": ("GcReport", "collect_garbage"),
    "ftsdp.storage.format._steps": (
        "apply_retention",
        "clear_steps",
        "list_steps",
        "read_manifest",
    ),
}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
