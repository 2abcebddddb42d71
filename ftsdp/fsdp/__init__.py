"""ftsdp.fsdp: the fully sharded data parallel engine (see docs/engine.md).

Layered one concept per module: ``_wrap`` plans the units, ``_unit`` owns one FlatParameter and
its lifecycle, ``_collectives`` and ``_streams`` move its bytes, ``_runtime`` drives the hooks,
``_init`` builds units (also from the meta device), ``_state_dict`` converts states, and
``_fully_sharded`` is the one public wrapper. This package never imports ``ftsdp.elastic``,
``ftsdp.trainer`` or ``ftsdp.storage``.
"""

from ._collectives import CommStats
from ._common import CPUOffload, MixedPrecision, ShardingStrategy
from ._fully_sharded import FSDP, FullyShardedDataParallel
from ._grad_scaler import ShardedGradScaler
from ._state_dict import ShardView

__all__ = [
    "FSDP",
    "CPUOffload",
    "CommStats",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardView",
    "ShardedGradScaler",
    "ShardingStrategy",
]
