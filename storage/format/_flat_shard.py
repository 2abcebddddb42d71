"""``FlatShard``: the one piece of sharded state the format knows, a rank's flat range."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatShard:
    """Elements ``[offset, offset + local.numel())`` of the row-major flattening of a tensor.

    ``global_shape`` is the shape of the whole (unsharded) tensor; ``local`` is the 1-D tensor this
    rank holds (on any device). ``save`` reads it, ``load`` fills it in place.

    ``layout``, optional: ``(start, chunk)`` of an ``even`` rule (docs/format.md, "Tensors
    described by a rule"): a FlatParameter's offset in its unit's flat buffer and the shard size
    (a wrong one is caught: the ranges are checked against it).
    """

    global_shape: tuple[int, ...]
    offset: int
    local: torch.Tensor  # 1-D, numel = this rank's length
    layout: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.global_shape)
        object.__setattr__(self, "global_shape", shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"FlatShard: global_shape={shape} has a negative dimension")
        if not isinstance(self.local, torch.Tensor) or self.local.dim() != 1:
            raise ValueError(
                "FlatShard: local must be a 1-D torch.Tensor, got "
                f"{type(self.local).__name__} of shape {getattr(self.local, 'shape', None)}"
            )
        numel = math.prod(shape)
        if self.layout is not None:
            start, chunk = (int(v) for v in self.layout)
            if start < 0 or chunk < 1:
                raise ValueError(
                    f"FlatShard: layout={self.layout} must be (start >= 0, chunk >= 1)"
                )
            object.__setattr__(self, "layout", (start, chunk))
        if self.offset < 0 or self.offset + self.local.numel() > numel:
            raise ValueError(
                f"FlatShard: offset={self.offset} length={self.local.numel()} does not fit in "
                f"global_shape={shape} ({numel} elements)"
            )

    @property
    def length(self) -> int:
        """Number of elements this rank holds."""
        return self.local.numel()
