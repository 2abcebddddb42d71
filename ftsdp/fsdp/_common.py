"""Small shared types of the engine: strategy, groups, lifecycle states, torch FSDP configs."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Groups:
    """The process groups a wrapped model uses."""

    shard: dist.ProcessGroup | None  # ranks that split a FlatParameter (None: F = 1)
    replicate: dist.ProcessGroup | None  # ranks holding the same shard (None: no replicas)
    world: dist.ProcessGroup | None  # every data-parallel rank (None: not distributed)


class ShardingStrategy(enum.Enum):
    """How a unit's FlatParameter is split across ranks (docs/engine.md, "The unit lifecycle")."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"  # torch's; refused by parse()

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """The member for itself, torch FSDP's member or its name (any case); else ValueError."""
        name = getattr(value, "name", value)
        if isinstance(name, str) and name.upper() == "_HYBRID_SHARD_ZERO2":
            raise ValueError(
                "sharding_strategy=_HYBRID_SHARD_ZERO2 is not supported by ftsdp; use "
                "HYBRID_SHARD (shard inside a group, replicate across groups)"
            )
        return enum_member(value, cls, "sharding_strategy")  # type: ignore[return-value]


def enum_member(value: Any, cls: type[enum.Enum], what: str) -> enum.Enum:
    """``value`` as a member of ``cls``: itself, or torch's enum of the same name."""
    if isinstance(value, cls):
        return value
    same_enum = isinstance(value, enum.Enum) and type(value).__name__ == cls.__name__
    if same_enum and value.name in cls.__members__:
        return cls[value.name]
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    valid = ", ".join(f"{cls.__name__}.{name}" for name in cls.__members__ if name[0] != "_")
    raise ValueError(f"{what}={value!r} is not one of: {valid}")


class UnitState(enum.Enum):
    """Where a unit's parameters live right now. See the lifecycle note in ``_unit.py``."""

    SHARDED = "SHARDED"  # only this rank's shard is allocated; modules see 1-D local slices
    GATHERING = "GATHERING"  # an asynchronous all-gather into the full buffer is in flight
    UNSHARDED = "UNSHARDED"  # the full flat parameter is allocated; modules see full views


class Phase(enum.Enum):
    """What the wrapped model is doing, tracked on the root for hook decisions."""

    IDLE = "IDLE"
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute and communication over fp32 master shards (torch FSDP's fields,
    in its order, with its defaults): ``cast_root_forward_inputs`` casts the root's floating
    inputs to ``param_dtype``, ``cast_forward_inputs`` every unit's (the root's follows the
    former). ``_module_classes_to_ignore`` is accepted and not honoured (a warning at the
    wrap): those modules compute in ``param_dtype`` like the rest."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: tuple[type, ...] = ()

    def __post_init__(self) -> None:
        if self.keep_low_precision_grads:
            raise ValueError(
                "MixedPrecision(keep_low_precision_grads=True) is not supported by ftsdp: the "
                "optimizer always steps on fp32 master shards with fp32 gradients; drop it"
            )
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(f"MixedPrecision: {name}={value!r} must be a floating torch.dtype")


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded parameters and gradients in host memory (docs/engine.md)."""

    offload_params: bool = False


def as_mixed_precision(value: Any) -> MixedPrecision | None:
    """``mixed_precision=`` as ftsdp's ``MixedPrecision`` (torch FSDP's is copied)."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    if type(value).__name__ == "MixedPrecision" and hasattr(value, "param_dtype"):
        return MixedPrecision(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            buffer_dtype=value.buffer_dtype,
            keep_low_precision_grads=getattr(value, "keep_low_precision_grads", False),
            cast_forward_inputs=bool(getattr(value, "cast_forward_inputs", False)),
            cast_root_forward_inputs=bool(getattr(value, "cast_root_forward_inputs", True)),
        )
    raise ValueError(f"mixed_precision must be an ftsdp.MixedPrecision, got {value!r}")


def as_cpu_offload(value: object) -> CPUOffload | None:
    """``cpu_offload=`` as ftsdp's ``CPUOffload`` (torch FSDP's is copied)."""
    if value is None or isinstance(value, CPUOffload):
        return value
    if type(value).__name__ == "CPUOffload" and hasattr(value, "offload_params"):
        return CPUOffload(offload_params=bool(value.offload_params))
    raise ValueError(f"cpu_offload must be an ftsdp.CPUOffload, got {value!r}")


def tree_map(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of nested dicts, lists, tuples and namedtuples."""
    if isinstance(value, dict):
        return {k: tree_map(v, fn) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(tree_map(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(tree_map(v, fn) for v in value)
    return fn(value)


# torch FSDP1's enums and configs (names, fields and defaults of torch.distributed.fsdp.api); the
# as_* functions also accept torch's own instances (docs/migrating.md)
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
