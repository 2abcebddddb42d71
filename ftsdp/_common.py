"""Small shared types of the engine: the sharding strategy and the unit lifecycle states."""

from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
    """How a unit's FlatParameter is split across the ranks of its process group.

    - ``FULL_SHARD``: parameters, gradients and optimizer state sharded; parameters are
      all-gathered before forward and again before backward, and freed after each.
    - ``SHARD_GRAD_OP``: as FULL_SHARD, but the unsharded parameters stay from forward to
      backward (one all-gather per step instead of two, more memory).
    - ``NO_SHARD``: every rank holds everything; gradients are all-reduced (DDP-like).
    - ``HYBRID_SHARD``: shard inside a group, replicate across groups (not implemented yet).
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Accept the enum or its name (case-insensitive); a clear ValueError otherwise."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        valid = ", ".join(cls.__members__)
        raise ValueError(f"sharding_strategy={value!r} is not one of: {valid}")


class UnitState(enum.Enum):
    """Where a unit's parameters live right now. See the lifecycle note in ``_unit.py``."""

    SHARDED = "SHARDED"  # only this rank's shard is allocated; modules see 1-D local slices
    UNSHARDED = "UNSHARDED"  # the full flat parameter is allocated; modules see full views


class Phase(enum.Enum):
    """What the wrapped model is doing, tracked on the root for hook decisions."""

    IDLE = "IDLE"
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
