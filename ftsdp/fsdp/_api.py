"""torch FSDP1's enums and configuration classes (the same names, fields and defaults as
``torch.distributed.fsdp.api``), so importing the engine does not import torch's FSDP; the
``as_*`` functions also accept torch's own instances. See docs/migrating.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from ._common import enum_member


class BackwardPrefetch(enum.Enum):
    """When backward starts the all-gather of the next unit (torch FSDP1's enum).

    - ``BACKWARD_PRE`` (what ftsdp does with ``backward_prefetch=True``, the default): before
      the current unit's gradient computation, so the next all-gather overlaps it.
    - ``BACKWARD_POST``: after it. Not implemented by ftsdp: passing it raises, naming
      ``BACKWARD_PRE`` and ``None``.
    - ``backward_prefetch=None`` (or ``False``): no backward prefetch.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns inside ``FSDP.state_dict_type(model, ...)``.

    - ``FULL_STATE_DICT`` (the default): unsharded tensors with the unwrapped module's keys.
    - ``SHARDED_STATE_DICT``: one ``DTensor`` per parameter, ``Shard(0)`` over the shard group
      (rows split as ``torch.chunk`` does, like torch FSDP); buffers as plain tensors. Savable
      with ``torch.distributed.checkpoint`` and loadable at any world size.
    - ``LOCAL_STATE_DICT``: FlatParameter shards in torch FSDP; not supported by ftsdp (its
      shards are an implementation detail): selecting it raises.
    """

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configs. ``offload_to_cpu``: tensors are copied to the CPU."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``FULL_STATE_DICT`` settings. ``rank0_only``: only rank 0 gets the tensors, the other
    ranks an empty dict (every rank still takes part in the gathers)."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """``LOCAL_STATE_DICT`` settings (the type itself is refused by ftsdp)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """``SHARDED_STATE_DICT`` settings. ``_use_dtensor`` is accepted for compatibility: ftsdp
    always returns DTensors."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs. ``offload_to_cpu`` (default ``True``, as in
    torch): state tensors are copied to the CPU."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``FULL_STATE_DICT`` settings of ``FSDP.optim_state_dict``. ``rank0_only``: only rank 0
    gets the state (saving); ``optim_state_dict_to_load`` then reads rank 0's input and
    broadcasts it."""

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """``LOCAL_STATE_DICT`` settings (the type itself is refused by ftsdp)."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """``SHARDED_STATE_DICT`` settings of ``FSDP.optim_state_dict`` (DTensor state)."""

    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """The state-dict type and configs of a wrapped model (``FSDP.get_state_dict_type``)."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


CONFIG_TYPES: dict[StateDictType, tuple[type, type]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def as_state_dict_type(value: Any) -> StateDictType:
    """ftsdp's ``StateDictType`` for ``value`` (ftsdp's or torch's member, or its name)."""
    return enum_member(value, StateDictType, "state_dict_type")  # type: ignore[return-value]


def as_config(value: Any, cls: type[Any]) -> Any:
    """``value`` as an instance of the config class ``cls``: ``None`` gives the defaults, an
    instance of torch's class of the same name is copied field by field."""
    if value is None:
        return cls()
    if isinstance(value, cls) and type(value) is cls:
        return value
    if type(value).__name__ == cls.__name__:  # torch's class of the same name
        return cls(**{f.name: getattr(value, f.name) for f in fields(cls)})
    raise ValueError(
        f"expected a {cls.__name__} (or None for its defaults), got {type(value).__name__}; "
        "the config type must match the state dict type, as in torch FSDP"
    )


def as_backward_prefetch(value: Any) -> bool:
    """``backward_prefetch=`` as ftsdp's switch: ``True`` / ``BACKWARD_PRE`` prefetch before
    the current unit's backward, ``False`` / ``None`` do not prefetch; ``BACKWARD_POST``
    raises (not implemented)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    member = enum_member(value, BackwardPrefetch, "backward_prefetch")
    if member is BackwardPrefetch.BACKWARD_POST:
        raise ValueError(
            "backward_prefetch=BackwardPrefetch.BACKWARD_POST is not implemented by ftsdp: its "
            "backward prefetch starts the next unit's all-gather before the current unit's "
            "gradient computation. Use BackwardPrefetch.BACKWARD_PRE (the default, most "
            "overlap) or backward_prefetch=None (no prefetch, least memory)"
        )
    return True
