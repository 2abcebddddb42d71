"""torch's ``torch.distributed.fsdp.fully_sharded_data_parallel`` path: the wrapper and the
names scripts import with it from there (docs/migrating.md): those of ``api`` and three more."""

from torch.distributed.fsdp import OptimStateKeyType

from . import api
from ._fully_sharded import FSDP, FullyShardedDataParallel
from .api import *  # noqa: F403  (torch's module holds its api names too)

__all__ = ["FSDP", "FullyShardedDataParallel", "OptimStateKeyType"]
__all__ += api.__all__
