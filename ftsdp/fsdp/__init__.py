"""ftsdp.fsdp: the fully sharded data parallel engine (see docs/engine.md).

Layered one concept per module: ``_wrap`` plans the units, ``_unit`` owns one FlatParameter and
its lifecycle, ``_collectives`` and ``_streams`` move its bytes, ``_runtime`` drives the hooks,
``_init`` builds units (also from the meta device), ``_state_dict`` converts states, and
``_fully_sharded`` is the one public wrapper. ``_api`` (torch FSDP1's enums and configs) and
``_fsdp1`` (its state APIs) let torch FSDP scripts run with only the import changed:
``torch.distributed.fsdp`` becomes ``ftsdp.fsdp`` and ``torch.distributed.fsdp.wrap`` becomes
``ftsdp.fsdp.wrap`` (docs/migrating.md). This package never imports ``ftsdp.elastic``,
``ftsdp.trainer`` or ``ftsdp.storage``.
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
