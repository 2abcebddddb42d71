"""ftsdp: checkpoint-centric, fault-tolerant fully sharded data parallel training for PyTorch."""

from ._collectives import CommStats
from ._common import CPUOffload, MixedPrecision, ShardingStrategy
from ._grad_scaler import ShardedGradScaler
from ._state_dict import ShardView
from .checkpoint import CheckpointManager, ResumeInfo
from .fully_sharded import FSDP, FullyShardedDataParallel

__all__ = [
    "FSDP",
    "CPUOffload",
    "CheckpointManager",
    "CommStats",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ResumeInfo",
    "ShardView",
    "ShardedGradScaler",
    "ShardingStrategy",
]
