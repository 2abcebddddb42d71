"""ftsdp.fsdp: the fully sharded data parallel engine (see docs/engine.md).

``_api`` and ``_fsdp1`` hold torch FSDP1's enums, configs and state APIs, so a torch FSDP
script runs with only its imports changed (docs/migrating.md). This package never imports
``ftsdp.elastic``, ``ftsdp.trainer`` or ``ftsdp.storage``.
"""

from ._api import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from ._collectives import CommStats
from ._common import CPUOffload, MixedPrecision, ShardingStrategy
from ._fully_sharded import FSDP, FullyShardedDataParallel
from ._grad_scaler import ShardedGradScaler
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
