"""ftsdp.fsdp: the fully sharded data parallel engine (docs/engine.md), with torch FSDP1's enums,
configs and state APIs (docs/migrating.md); it never imports another room of ftsdp."""

from ._collectives import CommStats, ShardedGradScaler
from ._common import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ._fully_sharded import FSDP, FullyShardedDataParallel
from ._state_dict import ShardView

__all__ = [
    "FSDP",
    "BackwardPrefetch",
    "CPUOffload",
    "CommStats",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "ShardView",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]
