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
    """When backward starts the all-gather of the next unit (torch FSDP1's enum):
    ``BACKWARD_PRE`` (ftsdp's ``backward_prefetch=True``); ``BACKWARD_POST`` is refused."""

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``model.state_dict()`` returns inside ``FSDP.state_dict_type(model, ...)``:
    ``FULL_STATE_DICT`` (default) or ``SHARDED_STATE_DICT`` (DTensors); ``LOCAL_STATE_DICT``
    is refused (docs/migrating.md)."""

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
    """``FULL_STATE_DICT`` settings of ``FSDP.optim_state_dict``; ``rank0_only`` also makes
    ``optim_state_dict_to_load`` broadcast rank 0's input."""

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
    """``value`` as an instance of the config class ``cls`` (``None``: the defaults; torch's
    class of the same name: copied field by field)."""
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
