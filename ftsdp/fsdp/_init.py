"""Building a wrapped model's units: device, process groups, deferred initialisation (a meta
model is materialised unit by unit: docs/engine.md, "Deferred initialisation")."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ._collectives import CommStats, all_gather_objects, group_size
from ._common import Groups, ShardingStrategy
from ._streams import HostSchedule
from ._unit import STALE_ATTR, FlatParamUnit, MemoryGauge, UnitOptions
from ._wrap import UnitPlan

if TYPE_CHECKING:
    from typing import TypeAlias

    from torch.distributed.device_mesh import DeviceMesh

    # process_group=: one group, or (shard group, replicate group) for HYBRID_SHARD
    ProcessGroups: TypeAlias = dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup]


def resolve_groups(
    strategy: ShardingStrategy,
    process_group: ProcessGroups | None,
    device_mesh: DeviceMesh | None,
) -> Groups:
    """Shard / replicate / world groups from ``process_group`` or a ``DeviceMesh``."""
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group= or device_mesh=, not both")
        if device_mesh.ndim == 2:
            if strategy is not ShardingStrategy.HYBRID_SHARD:
                raise ValueError(
                    f"a 2-D device_mesh means HYBRID_SHARD (replicate x shard); got "
                    f"sharding_strategy={strategy.name}"
                )
            return Groups(device_mesh.get_group(1), device_mesh.get_group(0), dist.group.WORLD)
        if device_mesh.ndim != 1:
            raise ValueError(f"device_mesh must be 1-D or 2-D, got {device_mesh.ndim}-D")
        process_group = device_mesh.get_group()
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if isinstance(process_group, tuple):
            if len(process_group) != 2 or not all(
                isinstance(g, dist.ProcessGroup) for g in process_group
            ):
                raise ValueError("HYBRID_SHARD takes process_group=(shard_group, replicate_group)")
            return Groups(process_group[0], process_group[1], dist.group.WORLD)
        if process_group is not None:
            raise ValueError(
                "HYBRID_SHARD needs a 2-D device_mesh=, a (shard_group, replicate_group) "
                "tuple, or nothing (shard within each node of LOCAL_WORLD_SIZE ranks)"
            )
        return _node_groups()
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            f"process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    if process_group is None and dist.is_initialized():
        process_group = dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        return Groups(None, process_group, process_group)
    return Groups(process_group, None, process_group)


def _node_groups() -> Groups:
    """HYBRID_SHARD's default: shard inside each node, replicate across nodes."""
    if not dist.is_initialized():
        raise ValueError("HYBRID_SHARD needs torch.distributed to be initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"HYBRID_SHARD: world size {world} is not a multiple of {local=}")
    shard = replicate = None
    for start in range(0, world, local):  # every rank creates every group, in order
        group = dist.new_group(list(range(start, start + local)))
        if start <= rank < start + local:
            shard = group
    for offset in range(local):
        group = dist.new_group(list(range(offset, world, local)))
        if rank % local == offset:
            replicate = group
    return Groups(shard, replicate, dist.group.WORLD)


def resolve_device(module: nn.Module, device_id: int | torch.device | None) -> torch.device:
    """The device the shards and compute live on."""
    if device_id is None:
        devices = {p.device for p in module.parameters() if not p.is_meta}
        if len(devices) > 1:
            raise ValueError(
                f"the module's parameters are on several devices {sorted(map(str, devices))}; "
                "pass device_id= or move the module to one device first"
            )
        return devices.pop() if devices else torch.device("cpu")
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
    if not isinstance(device, torch.device):
        raise ValueError(f"device_id must be an int or a torch.device, got {device_id!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device_id={device_id!r} names a CUDA device, but CUDA is not available")
    return device


def check_same_structure(plans: list[UnitPlan], group: dist.ProcessGroup | None) -> None:
    """Refuse a model that differs across ranks (it would hang a collective later)."""
    if group_size(group) == 1:
        return
    mine = [
        (
            sum(pp.param.numel() for pp in plan.params),
            sum(pp.param.numel() for pp in plan.params if pp.param.requires_grad),
            sorted({str(pp.param.dtype) for pp in plan.params}),
        )
        for plan in plans
    ]
    everyone = all_gather_objects(mine, group)
    differing = [r for r, row in enumerate(everyone) if row != everyone[0]]
    if differing:
        raise ValueError(
            "the wrapped model differs across ranks (per unit: parameter count, trainable "
            f"count, dtypes): rank 0 has {everyone[0]}, "
            + ", ".join(f"rank {r} has {everyone[r]}" for r in differing)
            + "; build the same model on every rank before wrapping"
        )


def build_units(
    module: nn.Module,
    plans: list[UnitPlan],
    options: UnitOptions,
    groups: Groups,
    stats: CommStats,
    param_init_fn: Callable[[nn.Module], None] | None,
    gauge: MemoryGauge,
    schedule: HostSchedule,
) -> list[FlatParamUnit]:
    """One FlatParamUnit per plan; a meta-device model is materialised unit by unit."""

    def build(plan: UnitPlan) -> FlatParamUnit:
        return FlatParamUnit(plan, options, groups, stats, gauge, schedule)

    # Units are built as the modules() walk passes their last module; an eager model builds
    # in the same order, so a meta-device rank and an eager one pair their broadcasts.
    unit_of = {id(pp.param): i for i, plan in enumerate(plans) for pp in plan.params}
    modules = list(module.modules())
    # per module, the units holding its parameters (an ignored parameter has none)
    owners = [
        sorted({unit_of[id(p)] for p in m._parameters.values() if id(p) in unit_of})
        for m in modules
    ]
    last_module = {u: index for index, us in enumerate(owners) for u in us}
    order = sorted(last_module, key=lambda u: (last_module[u], u))
    order += [u for u in range(len(plans)) if u not in last_module]
    units: list[FlatParamUnit | None] = [None] * len(plans)
    if any(pp.param.is_meta for plan in plans for pp in plan.params):
        materialized: set[int] = set()
        for index, m in enumerate(modules):
            for u in owners[index]:
                if u not in materialized:
                    _materialize(plans[u], options.device)
                    materialized.add(u)
            _materialize_buffers(m, options.device)
            if owners[index]:
                with torch.no_grad():
                    if param_init_fn is not None:
                        param_init_fn(m)
                    elif callable(reset := getattr(m, "reset_parameters", None)):
                        reset()
            for u in owners[index]:
                if last_module[u] == index:
                    units[u] = build(plans[u])
    else:
        # param_init_fn only initialises meta parameters (as in torch FSDP): rank 0 may hold
        # real weights while the others build on meta and receive them by sync_module_states.
        module.to(options.device)
    for u in order:
        if units[u] is None:
            units[u] = build(plans[u])
    return units  # type: ignore[return-value]


def _materialize(plan: UnitPlan, device: torch.device) -> None:
    """Allocate the plan's parameters on ``device`` (uninitialised), keeping ties."""
    for pp in plan.params:
        meta = pp.param
        real = nn.Parameter(
            torch.empty(meta.shape, dtype=meta.dtype, device=device),
            requires_grad=meta.requires_grad,
        )
        for owner, name in pp.refs:
            owner._parameters[name] = real
        setattr(meta, STALE_ATTR, True)
        pp.param = real


def _materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Meta buffers become zeros on ``device`` (``reset_parameters`` may fill them)."""
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
