"""ftsdp: fault-tolerant FSDP training; public names load on first use (docs/design.md)."""

from __future__ import annotations

import atexit
import importlib
import sys
import warnings
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it: what a training script needs
_EXPORTS = {
    "FSDP": "ftsdp.fsdp",
    "FullyShardedDataParallel": "ftsdp.fsdp",
    "ShardingStrategy": "ftsdp.fsdp",
    "MixedPrecision": "ftsdp.fsdp",
    "CPUOffload": "ftsdp.fsdp",
    "BackwardPrefetch": "ftsdp.fsdp",
    "ShardedGradScaler": "ftsdp.fsdp",
    "CheckpointManager": "ftsdp.checkpoint",
    "ResumeInfo": "ftsdp.checkpoint",
    "RankManager": "ftsdp.elastic",
}

# Names exported here before (CHANGELOG.md), now only in ftsdp.fsdp: a DeprecationWarning.
_MOVED = dict.fromkeys(
    [
        "CommStats",
        "FullOptimStateDictConfig",
        "FullStateDictConfig",
        "LocalOptimStateDictConfig",
        "LocalStateDictConfig",
        "OptimStateDictConfig",
        "ShardView",
        "ShardedOptimStateDictConfig",
        "ShardedStateDictConfig",
        "StateDictConfig",
        "StateDictSettings",
        "StateDictType",
    ],
    "ftsdp.fsdp",
)

__all__ = [  # the keys of _EXPORTS (tests/unit/test_layout.py checks)
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointManager",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "RankManager",
    "ResumeInfo",
    "ShardedGradScaler",
    "ShardingStrategy",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports on first use
    from ftsdp.checkpoint import CheckpointManager, ResumeInfo
    from ftsdp.elastic import RankManager
    from ftsdp.fsdp import (
        FSDP,
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardedGradScaler,
        ShardingStrategy,
    )

    __version__: str


def _version() -> str:
    """The installed distribution's version; ``0+unknown`` for a source tree not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ftsdp")
    except PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read from the metadata on first use, not at every import
        value = globals()["__version__"] = _version()
        return value
    if name in _MOVED:
        warnings.warn(
            f"ftsdp.{name} moved: use `from {_MOVED[name]} import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    module = _EXPORTS.get(name)
    if module is None:
        # Not an export: let ``from ftsdp import storage`` fall back to importing the submodule.
        raise AttributeError(f"module 'ftsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})


@atexit.register
def _let_gloo_workers_finish() -> None:
    """At exit, wait (at most 5 s) until gloo's worker threads are idle, as
    ``RankManager.close()`` does, or the process may abort (docs/elastic.md, "Teardown")."""
    if "torch.distributed" not in sys.modules:
        return
    from ftsdp.elastic._teardown import wait_for_idle_workers

    wait_for_idle_workers()
