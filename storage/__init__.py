"""storage: sharded, resharding-capable checkpoints on any fsspec URL (format: docs/format.md).

```python
h = storage.save(state, url, step=100, async_save=True)  # h.wait(), h.done(), h.blocking_seconds
storage.load(state, url)                                 # in place, newest committed step
storage.list_steps(url)                                  # committed steps, ascending
storage.load_state_dict(url, keys=None, dtype=None)      # full tensors in one process
```
Leaves of ``state``: ``torch.Tensor`` (whole), DTensor, ``FlatShard`` (a rank's flat range) or
JSON-able values. ``storage`` never imports ``ftsdp``.
"""

from storage._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NewerFormatError,
    StateMismatchError,
)
from storage._flat_shard import FlatShard
from storage._load import LoadResult, load, load_into, load_state_dict
from storage._manifest import FORMAT_VERSION, Manifest
from storage._options import IOOptions, LoadOptions, SaveOptions
from storage._save import SaveHandle, save
from storage._steps import apply_retention, list_steps, read_manifest

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FlatShard",
    "IOOptions",
    "IncompleteCheckpointError",
    "LoadOptions",
    "LoadResult",
    "Manifest",
    "NewerFormatError",
    "SaveHandle",
    "SaveOptions",
    "StateMismatchError",
    "apply_retention",
    "list_steps",
    "load",
    "load_into",
    "load_state_dict",
    "read_manifest",
    "save",
]
