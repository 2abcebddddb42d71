"""ftsdp.fsdp: the FSDP engine (docs/engine.md, docs/migrating.md); it imports no other room."""

from torch.distributed.fsdp import OptimStateKeyType

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
    "OptimStateKeyType",
    "ShardView",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]
