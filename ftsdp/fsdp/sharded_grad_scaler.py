"""torch's ``torch.distributed.fsdp.sharded_grad_scaler`` path (docs/migrating.md)."""

from ._collectives import ShardedGradScaler

__all__ = ["ShardedGradScaler"]
