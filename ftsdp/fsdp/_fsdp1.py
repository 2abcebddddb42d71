"""torch FSDP1's state APIs on ftsdp's units: state-dict types, optimizer state, full params.

What each produces (the same as torch FSDP1) is in docs/migrating.md. ``SHARDED_STATE_DICT``
is built one unit at a time (one all-gather per unit and state key) and loaded one parameter
at a time, so memory stays at the shards plus one unit.

[Note: which optimizer state is sharded] A state tensor that is 1-D with this rank's length of
the parameter (``exp_avg``, ``momentum_buffer``) mirrors the parameter's slice; anything else
(``step``) passes through. The ranks agree on which keys mirror before any collective on them,
so a rank whose slice is empty still takes part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._api import StateDictType
from ._collectives import all_gather_flat, all_reduce_flat
from ._common import ShardingStrategy
from ._state_dict import full_tensor, is_distributed, param_index, state_index
from ._unit import FlatParamUnit, ParamInfo

# The wrapper (``_fully_sharded.FullyShardedDataParallel``), which imports this module.
FullyShardedDataParallel = Any


def world_rank(model: FullyShardedDataParallel) -> int:
    """This rank in the model's data-parallel world (0 when not distributed)."""
    group = model._groups.world
    return dist.get_rank(group) if group is not None else 0


def _to_cpu(value: Any, enabled: bool) -> Any:
    if enabled and isinstance(value, torch.Tensor):
        return value.cpu()
    return value


def gather_flat(unit: FlatParamUnit, local: torch.Tensor) -> torch.Tensor:
    """The unit's full padded flat tensor from every rank's ``local`` (shard-sized)."""
    full = torch.empty(unit.padded_numel, dtype=local.dtype, device=unit.device)
    all_gather_flat(full, local.to(unit.device), unit.shard_group)
    return full


# ---------------------------------------------------------------------- DTensor layout
def _mesh(model: FullyShardedDataParallel) -> tuple[Any, list[Any]]:
    """The 1-D device mesh and placements of ``SHARDED_STATE_DICT`` tensors."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    if model._strategy is ShardingStrategy.HYBRID_SHARD:
        raise ValueError(
            "SHARDED_STATE_DICT is not supported with HYBRID_SHARD; use FULL_STATE_DICT, or "
            "model.sharded_state_dict() / ftsdp.CheckpointManager (any strategy, any world size)"
        )
    groups = model._groups
    sharded = groups.shard is not None
    group = groups.shard if sharded else groups.world
    if group is None:
        raise ValueError(
            "SHARDED_STATE_DICT needs torch.distributed to be initialised (its DTensors live "
            "on a process group); in one process use FULL_STATE_DICT"
        )
    if model._dtensor_mesh is None:
        model._dtensor_mesh = DeviceMesh.from_group(group, model._units[0].device.type)
    return model._dtensor_mesh, [Shard(0) if sharded else Replicate()]


def _to_dtensor(model: FullyShardedDataParallel, full: torch.Tensor, cpu: bool) -> Any:
    """``full`` (identical on every rank) as a DTensor, rows split as ``torch.chunk`` does."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = _mesh(model)
    if isinstance(placements[0], Shard) and full.dim() > 0:
        size, rank = mesh.size(), mesh.get_local_rank()
        chunks = full.chunk(size, dim=0)
        local = chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
    else:
        from torch.distributed.tensor import Replicate

        placements = [Replicate()]
        local = full
    local = _to_cpu(local.clone(), cpu)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _full_value(value: Any) -> Any:
    """A DTensor's or ShardedTensor's full tensor (a collective); anything else as is."""
    return full_tensor(value) if is_distributed(value) else value


# ---------------------------------------------------------------------- model state
def model_state_dict(model: FullyShardedDataParallel) -> dict[str, Any]:
    """``model.state_dict()`` under the model's state-dict settings (collective)."""
    from ._state_dict import full_state_dict

    settings = model._sd_settings
    config = settings.state_dict_config
    names = model._param_names()
    if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
        return _sharded_model_state(model, names, config.offload_to_cpu)
    full = full_state_dict(model._units, model.module, names)
    if getattr(config, "rank0_only", False) and world_rank(model) != 0:
        return {}
    return {key: _to_cpu(value, config.offload_to_cpu) for key, value in full.items()}


def _sharded_model_state(
    model: FullyShardedDataParallel, names: list[tuple[str, nn.Parameter]], cpu: bool
) -> dict[str, Any]:
    state = model.module.state_dict(keep_vars=True)
    index = state_index(model._units, state)
    full_params: dict[int, torch.Tensor] = {}
    for unit in model._units:
        if not unit.infos:
            continue
        flat = gather_flat(unit, unit.on_device(unit.shard))
        for info in unit.infos:
            full = flat[info.offset : info.offset + info.numel].view(info.shape)
            full_params[id(info)] = _to_dtensor(model, full, cpu)
        del flat
    out: dict[str, Any] = {}
    for key, value in state.items():
        info = index.get(key)
        out[key] = full_params[id(info)] if info else _to_cpu(value.detach().clone(), cpu)
    return out


def load_model_state_dict(
    model: FullyShardedDataParallel, state: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """``model.load_state_dict(state)``: full tensors, or DTensors (any layout) of them."""
    from ._state_dict import load_full_state_dict

    return load_full_state_dict(model._units, model.module, model._param_names(), state, strict)


# ---------------------------------------------------------------------- optimizer state
def _optim_params(
    model: FullyShardedDataParallel,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any] | None,
) -> list[tuple[int, str, nn.Parameter, ParamInfo | None, dict[str, Any]]]:
    """(group index, name, parameter, its ParamInfo or None if unmanaged, its state), in the
    optimizer's order. ``osd``: an ``optim.state_dict()`` to read the state from instead."""
    names = model._param_names()
    index = param_index(model._units, names)
    name_of: dict[int, str] = {}
    for name, p in names:
        name_of.setdefault(id(p), name)
    out = []
    for g, group in enumerate(optim.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in name_of:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of this model's; create "
                    "the optimizer from model.parameters() after wrapping"
                )
            name = name_of[id(p)]
            if osd is None:
                state = optim.state.get(p, {})
            else:  # the state dict names a parameter by its index in the groups
                state = osd["state"].get(osd["param_groups"][g]["params"][i], {})
            out.append((g, clean_name(name), p, index.get(name), state))
    return out


def clean_name(name: str) -> str:
    """A parameter name as torch FSDP's state dicts spell it: without the
    ``_checkpoint_wrapped_module.`` parts activation checkpointing's wrapper adds (its own
    state-dict hooks drop them from ``state_dict()`` keys too)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _mirrors(value: Any, info: ParamInfo | None) -> bool:
    """See [Note: which optimizer state is sharded]."""
    return (
        info is not None
        and isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.numel() == info.length
    )


def _agree_mirrors(
    model: FullyShardedDataParallel, entries: list[tuple[Any, ...]]
) -> list[set[str]]:
    """Per entry, the state keys that mirror the parameter on some rank (checked on all)."""
    mine = [
        sorted(k for k, v in state.items() if _mirrors(v, info)) for _, _, _, info, state in entries
    ]
    group = model._groups.world
    everyone: list[Any] = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    agreed = [set().union(*(row[i] for row in everyone)) for i in range(len(entries))]
    for (_, name, _, info, state), keys in zip(entries, agreed, strict=True):
        for key in keys:
            if not _mirrors(state.get(key), info):
                raise ValueError(
                    f"optimizer state {name}.{key} mirrors the parameter on some ranks but not "
                    "on this one (missing, or not a 1-D tensor of this rank's length); step the "
                    "optimizer on every rank before saving its state"
                )
    return agreed


def _full_optim_tensors(
    model: FullyShardedDataParallel, entries: list[tuple[Any, ...]], mirrors: list[set[str]]
) -> dict[tuple[str, str], torch.Tensor]:
    """Every mirroring state tensor, unsharded: one all-gather per unit and key."""
    by_unit: dict[int, list[int]] = {}
    unit_of = {id(info): unit for unit in model._units for info in unit.infos}
    for i, (_, _, _, info, _) in enumerate(entries):
        if mirrors[i]:
            by_unit.setdefault(id(unit_of[id(info)]), []).append(i)
    out: dict[tuple[str, str], torch.Tensor] = {}
    for unit in model._units:  # the same order on every rank
        members = by_unit.get(id(unit), [])
        keys = sorted({k for i in members for k in mirrors[i]})
        for key in keys:
            dtype = next(entries[i][4][key].dtype for i in members if key in mirrors[i])
            local = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.device)
            for i in members:
                if key in mirrors[i]:
                    info = entries[i][3]
                    local[info.shard_start : info.shard_start + info.length] = entries[i][4][key]
            flat = gather_flat(unit, local)
            for i in members:
                if key in mirrors[i]:
                    info = entries[i][3]
                    view = flat[info.offset : info.offset + info.numel].view(info.shape)
                    out[(entries[i][1], key)] = view
    return out


def optim_state_dict(
    model: FullyShardedDataParallel,
    optim: torch.optim.Optimizer,
    osd: dict[str, Any] | None,
) -> dict[str, Any]:
    """``FSDP.optim_state_dict``: the optimizer state keyed by parameter name (collective)."""
    settings = model._sd_settings
    config = settings.optim_state_dict_config
    cpu = config.offload_to_cpu
    sharded = settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
    entries = _optim_params(model, optim, osd)
    mirrors = _agree_mirrors(model, entries)
    full = _full_optim_tensors(model, entries, mirrors)
    if not sharded and getattr(config, "rank0_only", False) and world_rank(model) != 0:
        return {}
    state: dict[str, dict[str, Any]] = {}
    for i, (_, name, _, _, values) in enumerate(entries):
        if not values:
            continue
        entry = {}
        for key, value in values.items():
            if key in mirrors[i]:
                tensor = full[(name, key)]
                entry[key] = _to_dtensor(model, tensor, cpu) if sharded else _to_cpu(tensor, cpu)
            elif isinstance(value, torch.Tensor):
                entry[key] = _to_cpu(value.detach().clone(), cpu)
            else:
                entry[key] = value
        state[name] = entry
    groups = []
    source = osd["param_groups"] if osd is not None else optim.param_groups
    for g, group in enumerate(source):
        members = [name for gi, name, *_ in entries if gi == g]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    return {"state": state, "param_groups": groups}


def optim_state_dict_to_load(
    model: FullyShardedDataParallel, optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> dict[str, Any]:
    """``FSDP.optim_state_dict_to_load``: a name-keyed state dict (full tensors, or DTensors)
    as ``optim.state_dict()`` for this rank's shards (collective)."""
    settings = model._sd_settings
    config = settings.optim_state_dict_config
    if (
        settings.state_dict_type is StateDictType.FULL_STATE_DICT
        and getattr(config, "rank0_only", False)
        and model._groups.world is not None
    ):
        osd = _broadcast_from_rank0(osd, model)
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ValueError(
            "optim_state_dict_to_load expects what FSDP.optim_state_dict returned: a dict with "
            "'state' (by parameter name) and 'param_groups' (listing parameter names)"
        )
    entries = _optim_params(model, optim, None)
    state: dict[int, dict[str, Any]] = {}
    for index, (_, name, _, info, _) in enumerate(entries):  # the same order on every rank
        saved = osd["state"].get(name)
        if saved is None:
            continue
        entry = {}
        for key in sorted(saved):
            value = _full_value(saved[key])
            if (
                info is not None
                and isinstance(value, torch.Tensor)
                and _is_param_shaped(value, info)
            ):
                piece = value.reshape(-1)[info.param_start : info.param_start + info.length]
                entry[key] = piece.clone()
            elif isinstance(value, torch.Tensor):
                entry[key] = value.clone()
            else:
                entry[key] = value
        state[index] = entry
    saved_groups = osd["param_groups"]
    groups = []
    position = 0
    for g, group in enumerate(optim.param_groups):
        members = [name for gi, name, *_ in entries if gi == g]
        match = next(
            (sg for sg in saved_groups if members and members[0] in sg.get("params", [])),
            saved_groups[g] if g < len(saved_groups) else None,
        )
        if match is None:
            raise ValueError(
                f"optim_state_dict_to_load: the saved state has {len(saved_groups)} param "
                f"groups, the optimizer {len(optim.param_groups)}"
            )
        hyper = {k: v for k, v in match.items() if k != "params"}
        groups.append({**hyper, "params": list(range(position, position + len(group["params"])))})
        position += len(group["params"])
    return {"state": state, "param_groups": groups}


def _is_param_shaped(value: torch.Tensor, info: ParamInfo) -> bool:
    return value.dim() > 0 and tuple(value.shape) == tuple(info.shape)


class _TensorMeta:
    """A tensor's place in a broadcast structure: its shape and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _broadcast_from_rank0(osd: Any, model: FullyShardedDataParallel) -> Any:
    """rank 0's ``osd`` on every rank: its structure as one object, then each tensor."""
    group = model._groups.world
    rank = dist.get_rank(group)
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _TensorMeta(value)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    holder = [strip(osd) if rank == 0 else None]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    device = model._units[0].device
    received = iter(tensors)

    def fill(value: Any) -> Any:
        if isinstance(value, _TensorMeta):
            buffer = (
                next(received).to(device)
                if rank == 0
                else torch.empty(value.shape, dtype=value.dtype, device=device)
            )
            dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
            return buffer
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(v) for v in value)
        return value

    return fill(holder[0])


# ---------------------------------------------------------------------- full parameters
@contextlib.contextmanager
def summon_full_params(
    model: FullyShardedDataParallel,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Iterator[None]:
    """See ``FSDP.summon_full_params``: every unit's parameters as full ``nn.Parameter``s."""
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported (as in torch "
            "FSDP): only rank 0 would hold the edits; pass writeback=False"
        )
    if with_grads and offload_to_cpu:
        raise ValueError(
            "summon_full_params(with_grads=True, offload_to_cpu=True) is not supported (as in "
            "torch FSDP)"
        )
    model._require_idle("summon_full_params()")
    units = model._units if recurse else model._units[:1]
    for unit in model._units:
        unit.reshard()  # a forward without backward may have left units gathered (local)
    exposed = rank0_only is False or world_rank(model) == 0
    grads = _full_grads(model, units) if with_grads else {}
    summoned: list[tuple[ParamInfo, nn.Parameter]] = []
    for unit in units:
        if not unit.infos:
            continue
        flat = _to_cpu(gather_flat(unit, unit.on_device(unit.shard)), offload_to_cpu)
        if not exposed:
            continue
        for info in unit.infos:
            full = nn.Parameter(
                flat[info.offset : info.offset + info.numel].view(info.shape),
                requires_grad=info.requires_grad,
            )
            full.grad = grads.get(id(info))
            for module, name in info.refs:
                module._parameters[name] = full
            summoned.append((info, full))
    model._summoned = True
    try:
        yield
        if writeback:
            _write_back(summoned)
    finally:
        model._summoned = False
        for info, _ in summoned:
            for module, name in info.refs:
                module._parameters[name] = info.sharded_param


def _write_back(summoned: list[tuple[ParamInfo, nn.Parameter]]) -> None:
    """Copy this rank's slice of every (possibly edited or replaced) full parameter back."""
    plan = []
    for info, _ in summoned:
        module, name = info.refs[0]
        current = module._parameters[name]
        if current is None or current.numel() != info.numel:
            got = None if current is None else tuple(current.shape)
            raise ValueError(
                f"summon_full_params: {info.fqn!r} was replaced by a tensor of shape {got}, "
                f"expected {tuple(info.shape)}; edit the parameters in place"
            )
        plan.append((info, current))
    with torch.no_grad():
        for info, current in plan:
            piece = current.detach().reshape(-1)[info.param_start : info.param_start + info.length]
            info.sharded_param.copy_(piece)


def _full_grads(
    model: FullyShardedDataParallel, units: list[FlatParamUnit]
) -> dict[int, torch.Tensor]:
    """Full gradients of the parameters that have one on some rank (collective)."""
    infos = [info for unit in units for info in unit.infos]
    present = torch.tensor(
        [info.sharded_param.grad is not None for info in infos],
        dtype=torch.uint8,
        device=model._units[0].device,
    )
    if model._groups.world is not None and present.numel():
        all_reduce_flat(present, model._groups.world, op=dist.ReduceOp.MAX)
    has = dict(zip((id(i) for i in infos), present.tolist(), strict=True))
    out: dict[int, torch.Tensor] = {}
    for unit in units:
        if not any(has[id(info)] for info in unit.infos):
            continue
        local = torch.zeros(unit.shard_numel, dtype=unit.dtype, device=unit.device)
        for info in unit.infos:
            grad = info.sharded_param.grad
            if grad is not None:
                local[info.shard_start : info.shard_start + info.length] = grad.reshape(-1)
        flat = gather_flat(unit, local)
        for info in unit.infos:
            if has[id(info)]:
                out[id(info)] = flat[info.offset : info.offset + info.numel].view(info.shape)
    return out
