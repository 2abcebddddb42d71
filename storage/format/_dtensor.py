"""Adapter: a DTensor's local shard as a flat range (when that shard is contiguous)."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from ftsdp.storage.format._ranges import Range


def is_dtensor(obj: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (never imports it: none exists before)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def dtensor_range(name: str, dt: Any) -> tuple[tuple[int, ...], Range, torch.Tensor]:
    """``(global_shape, flat range, local tensor)`` of this rank's shard of DTensor ``dt``.

    Supports any mix of ``Replicate()`` and ``Shard(d)`` whose local chunk is contiguous in the
    row-major flattening (``Shard(0)`` always is); ``Partial`` and non-contiguous chunks raise.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in dt.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(
                f"{name}: DTensor placement {p} is not supported; redistribute to Shard(0) or "
                "Replicate() before saving"
            )
    shape = tuple(dt.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(
        shape, dt.device_mesh, dt.placements
    )
    numel = math.prod(local_shape)
    local = getattr(dt, "_local_tensor", None)  # to_local() goes through autograd
    local = local if isinstance(local, torch.Tensor) else dt.to_local()
    if numel == 0:
        return shape, Range(0, 0), local
    # Contiguous iff every dim after the last partial one is full and every dim before it is 1.
    partial = [i for i, (s, g) in enumerate(zip(local_shape, shape, strict=True)) if s != g]
    if partial and any(local_shape[i] != 1 for i in range(partial[-1])):
        raise ValueError(
            f"{name}: DTensor shard of shape {tuple(local_shape)} at {tuple(offsets)} of "
            f"{shape} is not contiguous in row-major order; use Shard(0)"
        )
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    start = sum(o * s for o, s in zip(offsets, strides, strict=True))
    return shape, Range(start, numel), local
