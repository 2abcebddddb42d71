"""saving: writing and committing a step: sync, async and deferred saves, node-local roots."""

from ftsdp.storage import _lazy

_MODULES = {
    "_commit": ("CommitConflictError",),
    "_nodes": ("clear_on_nodes", "restore_on_nodes"),
    "_save": (
        "SaveHandle",
        "prepare_save",
        "save",
        "save_on_nodes",
        "snapshot_fence",
        "wait_snapshot",
    ),
}
__all__, __getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
