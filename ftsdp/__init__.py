"""ftsdp: checkpoint-centric, fault-tolerant fully sharded data parallel training for PyTorch.

The public names below are loaded on first use, so ``import ftsdp.storage`` (checkpoints for
inference, the CLI) does not load the engine or the trainer. Subpackages: ``ftsdp.fsdp`` (the
engine), ``ftsdp.elastic`` (the rank manager), ``ftsdp.storage`` (checkpoint format and I/O),
``ftsdp.trainer`` (CheckpointManager, the training entry's pieces), ``ftsdp.tools`` (CLIs and
benchmarks). See docs/design.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "FSDP": "ftsdp.fsdp",
    "CPUOffload": "ftsdp.fsdp",
    "CommStats": "ftsdp.fsdp",
    "FullyShardedDataParallel": "ftsdp.fsdp",
    "MixedPrecision": "ftsdp.fsdp",
    "ShardView": "ftsdp.fsdp",
    "ShardedGradScaler": "ftsdp.fsdp",
    "ShardingStrategy": "ftsdp.fsdp",
    # torch FSDP1's names, so its scripts run with only the import changed (docs/migrating.md)
    "BackwardPrefetch": "ftsdp.fsdp",
    "FullOptimStateDictConfig": "ftsdp.fsdp",
    "FullStateDictConfig": "ftsdp.fsdp",
    "LocalOptimStateDictConfig": "ftsdp.fsdp",
    "LocalStateDictConfig": "ftsdp.fsdp",
    "OptimStateDictConfig": "ftsdp.fsdp",
    "ShardedOptimStateDictConfig": "ftsdp.fsdp",
    "ShardedStateDictConfig": "ftsdp.fsdp",
    "StateDictConfig": "ftsdp.fsdp",
    "StateDictSettings": "ftsdp.fsdp",
    "StateDictType": "ftsdp.fsdp",
    "CheckpointManager": "ftsdp.trainer",
    "ResumeInfo": "ftsdp.trainer",
}

__all__ = [  # the keys of _EXPORTS (tests/unit/test_layout.py checks)
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "CheckpointManager",
    "CommStats",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "ResumeInfo",
    "ShardView",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports on first use
    from ftsdp.fsdp import (
        FSDP,
        BackwardPrefetch,
        CommStats,
        CPUOffload,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        FullyShardedDataParallel,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        OptimStateDictConfig,
        ShardedGradScaler,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        ShardingStrategy,
        ShardView,
        StateDictConfig,
        StateDictSettings,
        StateDictType,
    )
    from ftsdp.trainer import CheckpointManager, ResumeInfo


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # Not an export: let ``from ftsdp import storage`` fall back to importing the submodule.
        raise AttributeError(f"module 'ftsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
