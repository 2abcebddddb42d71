"""storage: sharded, resharding-capable checkpoints on any fsspec URL; ``storage`` never imports the
rest of ``ftsdp``. The calls in brief: docs/format.md, "The calls"; the rooms and what each
exports: docs/design.md, "The map"."""

import importlib as _importlib
import typing as _typing
import warnings as _warnings

# the rooms, as attributes (``storage.catalog.verify``)
from ftsdp.storage import catalog, conversion, format, inference, io, loading, saving  # noqa: F401
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
from ftsdp.storage.format._state import FlatShard
from ftsdp.storage.format._steps import list_steps
from ftsdp.storage.inference._inference import LazyStateDict, load_into, load_state_dict
from ftsdp.storage.loading._load import LoadResult, load
from ftsdp.storage.saving._commit import CommitConflictError
from ftsdp.storage.saving._save import SaveHandle, save

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "FlatShard",
    "IOOptions",
    "IncompleteCheckpointError",
    "LazyStateDict",
    "LoadOptions",
    "LoadResult",
    "NewerFormatError",
    "SaveHandle",
    "SaveOptions",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "list_steps",
    "load",
    "load_into",
    "load_state_dict",
    "save",
]

# Names exported here before the rooms had their own (CHANGELOG.md): they still resolve, with a
# DeprecationWarning naming the room.
_MOVED = {
    name: f"ftsdp.storage.{room}"
    for room, names in {
        "catalog": "GcReport VerifyReport apply_retention clear_steps collect_garbage diff "
        "inspect_checkpoint read_manifest verify",
        "conversion": "FORMATS ConvertResult convert detect_format reshard",
        "format": "FORMAT_VERSION Manifest",
        "saving": "clear_on_nodes prepare_save restore_on_nodes snapshot_fence wait_snapshot",
        "io": "DEFAULT_MAX_MEMORY",
        "inference": "LoadIntoResult",
    }.items()
    for name in names.split()
}


def __getattr__(name: str) -> _typing.Any:
    if name in _MOVED:
        _warnings.warn(
            f"ftsdp.storage.{name} moved: use `from {_MOVED[name]} import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'ftsdp.storage' has no attribute {name!r}")
