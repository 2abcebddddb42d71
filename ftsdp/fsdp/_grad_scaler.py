"""fp16 loss scaling whose found-inf flag every rank agrees on (docs/engine.md, "fp16")."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._collectives import comm_device, group_size


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose skip decision every rank of ``process_group`` (default:
    the world) agrees on."""

    def __init__(
        self,
        device: str = "cuda",
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device, **kwargs)
        self._group = process_group

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks that agree (the world unless given, looked up at each step)."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return self._group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # fp16 gradients are allowed: a model kept in fp16 without MixedPrecision has them.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        group = self.process_group
        if group_size(group) == 1:
            return per_device
        # One flag for the whole rank, on the device the group communicates on. A rank with
        # no gradient at all (every shard empty) still takes part, or the others would hang.
        comm = comm_device(group)
        flag = torch.zeros(1, dtype=torch.float32, device=comm)
        for value in per_device.values():
            flag = torch.maximum(flag, value.to(comm, torch.float32).reshape(1))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not per_device:
            per_device[found_inf.device] = found_inf
        for device, value in per_device.items():
            value.copy_(flag.to(device).reshape(value.shape))
        return per_device
