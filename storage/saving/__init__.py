"""saving: writing and committing a step: sync, async and deferred saves, node-local roots."""

from ftsdp.storage.format._state import WalkedPart, walk_part
from ftsdp.storage.saving._commit import CommitConflictError, guard_commits
from ftsdp.storage.saving._nodes import clear_on_nodes, restore_on_nodes
from ftsdp.storage.saving._save import (
    SaveHandle,
    Worker,
    prepare_save,
    queued_work_event,
    release,
    save,
    save_on_nodes,
    side_stream,
    snapshot_fence,
    wait_snapshot,
)
from ftsdp.storage.saving._shares import (
    RootForRanks,
    describe,
    leaf_rows,
    object_checksums,
    plan_for_ranks,
)

__all__ = [
    "CommitConflictError",
    "RootForRanks",
    "SaveHandle",
    "WalkedPart",
    "Worker",
    "clear_on_nodes",
    "describe",
    "guard_commits",
    "leaf_rows",
    "object_checksums",
    "plan_for_ranks",
    "prepare_save",
    "queued_work_event",
    "release",
    "restore_on_nodes",
    "save",
    "save_on_nodes",
    "side_stream",
    "snapshot_fence",
    "wait_snapshot",
    "walk_part",
]
