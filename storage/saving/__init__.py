"""saving: writing and committing a step: sync, async and deferred saves, node-local roots."""

from ftsdp.storage.saving._commit import CommitConflictError, guard_commits
from ftsdp.storage.saving._nodes import clear_on_nodes, restore_on_nodes
from ftsdp.storage.saving._save import (
    SaveHandle,
    prepare_save,
    save,
    save_on_nodes,
    snapshot_fence,
    wait_snapshot,
)

__all__ = [
    "CommitConflictError",
    "SaveHandle",
    "clear_on_nodes",
    "guard_commits",
    "prepare_save",
    "restore_on_nodes",
    "save",
    "save_on_nodes",
    "snapshot_fence",
    "wait_snapshot",
]
