"""storage: sharded, resharding-capable checkpoints on any fsspec URL (format: docs/format.md).

```python
h = storage.save(state, url, step=100, async_save=True)  # h.wait(), h.done(), h.blocking_seconds
h = storage.save(state, url, 100, async_save=True, defer_copy=True)  # copies in the background:
storage.snapshot_fence(optimizer)                        # ... step() waits for that copy
storage.load(state, url)                                 # in place, newest committed step
storage.list_steps(url)                                  # committed steps, ascending
storage.load_state_dict(url, keys=None, dtype=None)      # full tensors in one process
storage.load_into(module, url)                           # also a module on the meta device
storage.LazyStateDict(url)                               # tensors read on first access
storage.convert(src, dst, to="hf")                       # ftsdp / hf / torch / dcp, streamed
storage.save(state, "/dev/shm/x", 7, node=host)          # node-local roots, each with a replica:
storage.restore_on_nodes("/dev/shm/x", node=host)        # ... completes every node's before load
```
Leaves of ``state``: ``torch.Tensor`` (whole), DTensor, ``FlatShard`` (a rank's flat range) or
JSON-able values. ``storage`` never imports ``ftsdp``.
"""

from ftsdp.storage._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NewerFormatError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ftsdp.storage._options import IOOptions, LoadOptions, SaveOptions
from ftsdp.storage.catalog._checks import VerifyReport, diff, inspect_checkpoint, verify
from ftsdp.storage.catalog._gc import GcReport, collect_garbage
from ftsdp.storage.catalog._steps import apply_retention, clear_steps, list_steps, read_manifest
from ftsdp.storage.conversion._convert import ConvertResult, convert, reshard
from ftsdp.storage.conversion._formats import FORMATS, detect_format
from ftsdp.storage.format._flat_shard import FlatShard
from ftsdp.storage.format._manifest import FORMAT_VERSION, Manifest
from ftsdp.storage.inference._inference import (
    LazyStateDict,
    LoadIntoResult,
    load_into,
    load_state_dict,
)
from ftsdp.storage.io._streaming import DEFAULT_MAX_MEMORY
from ftsdp.storage.loading._load import LoadResult, load
from ftsdp.storage.saving._commit import CommitConflictError
from ftsdp.storage.saving._nodes import clear_on_nodes, restore_on_nodes
from ftsdp.storage.saving._save import (
    SaveHandle,
    prepare_save,
    save,
    snapshot_fence,
    wait_snapshot,
)

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "FORMATS",
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "ConvertResult",
    "CorruptCheckpointError",
    "FlatShard",
    "GcReport",
    "IOOptions",
    "IncompleteCheckpointError",
    "LazyStateDict",
    "LoadIntoResult",
    "LoadOptions",
    "LoadResult",
    "Manifest",
    "NewerFormatError",
    "SaveHandle",
    "SaveOptions",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "VerifyReport",
    "apply_retention",
    "clear_on_nodes",
    "clear_steps",
    "collect_garbage",
    "convert",
    "detect_format",
    "diff",
    "inspect_checkpoint",
    "list_steps",
    "load",
    "load_into",
    "load_state_dict",
    "prepare_save",
    "read_manifest",
    "reshard",
    "restore_on_nodes",
    "save",
    "snapshot_fence",
    "verify",
    "wait_snapshot",
]
