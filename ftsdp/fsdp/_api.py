"""torch FSDP1's enums and configs (names, fields and defaults of ``torch.distributed.fsdp.api``);
the ``as_*`` functions also accept torch's own instances (docs/migrating.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from ._common import enum_member


class BackwardPrefetch(enum.Enum):
    """When backward prefetches the next unit (``BACKWARD_POST`` is refused)."""

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns (``LOCAL_STATE_DICT`` is refused)."""

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass
class StateDictConfig:
    """Base of the model state-dict configs. ``offload_to_cpu``: tensors are copied to the CPU."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``FULL_STATE_DICT`` settings. ``rank0_only``: the other ranks get ``{}``."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """``LOCAL_STATE_DICT`` settings (the type itself is refused by ftsdp)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """``SHARDED_STATE_DICT`` settings (ftsdp always returns DTensors)."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Base of the optimizer state-dict configs (``offload_to_cpu`` on, as in torch)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """``FULL_STATE_DICT`` optimizer settings (``rank0_only``: load broadcasts rank 0's input)."""

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
    """``value`` as a ``cls`` (``None``: the defaults; torch's class of that name: copied)."""
    if value is None:
        return cls()
    if type(value) is cls:
        return value
    if type(value).__name__ == cls.__name__:  # torch's class of the same name
        return cls(**{f.name: getattr(value, f.name) for f in fields(cls)})
    raise ValueError(
        f"expected a {cls.__name__} (or None for its defaults), got {type(value).__name__}; "
        "the config type must match the state dict type, as in torch FSDP"
    )


def as_backward_prefetch(value: Any) -> bool:
    """``backward_prefetch=`` as ftsdp's switch (``BACKWARD_POST`` raises)."""
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
