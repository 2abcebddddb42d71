"""A wrapped model's state: as plain data (full state dicts, ShardViews: docs/design.md), and
through torch FSDP1's state APIs (docs/migrating.md), built one unit at a time, so memory stays at
the shards plus one unit."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._collectives import (
    all_gather_flat,
    all_gather_objects,
    all_reduce_flat,
    comm_device,
    group_rank,
)
from ._common import ShardingStrategy, StateDictType, tree_map
from ._unit import FlatParamUnit, ParamInfo


@dataclass(frozen=True)
class ShardView:
    """This rank's flat range ``[offset, offset + length)`` of one tensor; ``local`` (1-D) aliases
    the live storage (the parameter's shard, or an optimizer state), so writes load in place."""

    name: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    length: int
    local: torch.Tensor
    layout: tuple[int, int] | None = None  # (start, chunk) in the unit's flat buffer, if sharded

    def __post_init__(self) -> None:
        if self.local.dim() != 1 or self.local.numel() != self.length:
            raise ValueError(
                f"ShardView {self.name!r}: local must be 1-D with length={self.length} "
                f"elements, got shape {tuple(self.local.shape)}"
            )


def is_distributed(value: Any) -> bool:
    """A DTensor or a ShardedTensor (what torch FSDP1's sharded state dicts hold)."""
    return hasattr(value, "full_tensor") or (
        hasattr(value, "local_shards") and hasattr(value, "metadata")
    )


def full_tensor(value: Any) -> torch.Tensor:
    """The whole tensor a DTensor or ShardedTensor describes (a collective over its group)."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    group = value._process_group
    full = torch.zeros(value.shape, dtype=value.dtype, device=comm_device(group))
    for shard in value.local_shards():
        meta = shard.metadata
        where = tuple(
            slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes, strict=True)
        )
        full[where] = shard.tensor
    dist.all_reduce(full, group=group)  # every element is held by exactly one rank
    return full


def gather_flat(unit: FlatParamUnit, local: torch.Tensor) -> torch.Tensor:
    """The unit's full padded flat tensor from every rank's ``local`` (shard-sized)."""
    full = torch.empty(unit.padded_numel, dtype=local.dtype, device=unit.device)
    all_gather_flat(full, local.to(unit.device), unit.shard_group)
    return full


def state_index(units: list[FlatParamUnit], state: dict[str, Any]) -> dict[str, ParamInfo]:
    """Each ``state_dict(keep_vars=True)`` key holding a managed parameter -> its ParamInfo;
    by identity, so renamed keys and a gathered unit's full parameters are found too."""
    by_param: dict[int, ParamInfo] = {}
    for unit in units:
        for info in unit.infos:
            by_param[id(info.sharded_param)] = info
            for module, name in info.refs:
                current = module._parameters.get(name)
                if current is not None:
                    by_param.setdefault(id(current), info)
    return {key: by_param[id(v)] for key, v in state.items() if id(v) in by_param}


def full_state_dict(
    units: list[FlatParamUnit],
    module: nn.Module,
    convert: Callable[[torch.Tensor], Any] = torch.Tensor.clone,
    keep_vars: bool = False,
) -> dict[str, Any]:
    """The unwrapped module's state, full parameters gathered a unit at a time (collective);
    ``keep_vars``: the buffers themselves, not detached."""
    full_params: dict[int, Any] = {}
    for unit in units:
        if unit.infos:
            flat = gather_flat(unit, unit.on_device(unit.shard))
            for info in unit.infos:
                full = flat[info.offset : info.offset + info.numel].view(info.shape)
                full_params[id(info)] = convert(full)
    state = module.state_dict(keep_vars=True)
    index = state_index(units, state)
    out = {}
    for key, value in state.items():
        if key in index:
            out[key] = full_params[id(index[key])]
        else:
            out[key] = value if keep_vars else value.detach()
    return out


class _LoadError(RuntimeError, ValueError):
    """A state dict that does not fit the model: a ``RuntimeError``, as torch's
    ``load_state_dict`` raises (scripts catch that to retry with ``strict=False``), and the
    ``ValueError`` ftsdp raised before."""


def load_full_state_dict(
    units: list[FlatParamUnit], module: nn.Module, state: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Copy this rank's slice of full tensors (or DTensors / ShardedTensors) into the shards,
    only once every check passed; returns (missing, unexpected)."""
    expected = module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if strict and (missing or unexpected):
        raise _LoadError(
            f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}; "
            "pass strict=False to load the keys that match"
        )
    index = state_index(units, expected)
    present = [(key, current, state[key]) for key, current in expected.items() if key in state]
    for key, current, value in present:
        shape = index[key].shape if key in index else current.shape
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise _LoadError(
                f"load_state_dict: {key!r} has shape {got}, the model expects {tuple(shape)}"
            )
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source) pairs
    for key, current, value in present:
        distributed = is_distributed(value)
        if distributed:
            value = full_tensor(value)
        info = index.get(key)
        if info is None:
            plan.append((current, value))
        else:
            src = value.reshape(-1)[info.param_start : info.param_start + info.length]
            plan.append((info.sharded_param, src.clone() if distributed else src))
    with torch.no_grad():  # all checks passed: nothing is loaded half-way on a bad input
        for dst, src in plan:
            dst.copy_(src)
    return missing, unexpected


def sharded_state_dict(units: list[FlatParamUnit], module: nn.Module) -> dict[str, ShardView]:
    """Parameters (each once, under its first name) and persistent buffers as ShardViews."""
    state = module.state_dict(keep_vars=True)
    index = state_index(units, state)
    out: dict[str, ShardView] = {}
    seen: set[int] = set()
    for key, value in state.items():
        info = index.get(key)
        if info is None:
            flat = value.detach().reshape(-1)
            out[key] = ShardView(key, tuple(value.shape), value.dtype, 0, flat.numel(), flat)
        elif id(info) not in seen:
            seen.add(id(info))
            out[key] = _view_of(key, info, info.sharded_param.detach())
    return out


def mirrors(value: Any, info: ParamInfo | None) -> bool:
    """Whether an optimizer state value mirrors its parameter's slice (docs/design.md)."""
    return (
        info is not None
        and isinstance(value, torch.Tensor)
        and value.dim() == 1
        and value.numel() == info.length
    )


def optim_entries(
    units: list[FlatParamUnit],
    names: list[tuple[str, nn.Parameter]],
    optim: torch.optim.Optimizer,
    osd: dict[str, Any] | None = None,
) -> list[tuple[int, str, ParamInfo | None, dict[str, Any]]]:
    """``(group, name, ParamInfo or None, state)`` per optimizer parameter (state from ``osd``)."""
    infos = {id(info.sharded_param): info for unit in units for info in unit.infos}
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
            if osd is None:
                state = optim.state.get(p, {})
            else:  # the state dict names a parameter by its index in the groups
                state = osd["state"].get(osd["param_groups"][g]["params"][i], {})
            out.append((g, name_of[id(p)], infos.get(id(p)), state))
    return out


def groups_by_name(groups: list[dict[str, Any]], entries: list[tuple[Any, ...]]) -> list[Any]:
    """``param_groups`` with each group's ``params`` listed by name."""
    out = []
    for g, group in enumerate(groups):
        members = [e[1] for e in entries if e[0] == g]
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    return out


def sharded_optim_state_dict(
    units: list[FlatParamUnit],
    names: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any]:
    """Optimizer state by parameter name, mirroring state (``exp_avg``) as ShardViews."""
    entries = optim_entries(units, names, optimizer)
    state = {
        name: {
            key: _view_of(f"{name}.{key}", info, v) if info is not None and mirrors(v, info) else v
            for key, v in values.items()
        }
        for _, name, info, values in entries
    }
    return {"state": state, "param_groups": groups_by_name(optimizer.param_groups, entries)}


def _view_of(name: str, info: ParamInfo, local: torch.Tensor) -> ShardView:
    layout = (info.offset, info.chunk) if info.chunk else None
    shape = tuple(info.shape)
    return ShardView(name, shape, local.dtype, info.param_start, info.length, local, layout)


# The wrapper (``_fully_sharded.FullyShardedDataParallel``), which imports this module.
FullyShardedDataParallel = Any


def _to_cpu(value: Any, enabled: bool) -> Any:
    return value.cpu() if enabled and isinstance(value, torch.Tensor) else value


def _not_rank0(model: FullyShardedDataParallel, config: Any) -> bool:
    """``rank0_only`` is set and this is not rank 0: the state is ``{}`` here."""
    return getattr(config, "rank0_only", False) and group_rank(model._groups.world) != 0


def _to_dtensor(model: FullyShardedDataParallel, full: torch.Tensor, cpu: bool) -> Any:
    """``full`` (the same on every rank) as a DTensor: rows chunked over the shard group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

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
    mesh = model._dtensor_mesh
    placements: list[Any] = [Replicate()]
    local = full
    if sharded and full.dim() > 0:
        chunks = full.chunk(mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        local = chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))
        placements = [Shard(0)]
    local = _to_cpu(local.clone(), cpu)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def model_state_dict(model: FullyShardedDataParallel, keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict()`` under the model's state-dict settings (collective)."""
    config = model._sd_settings.state_dict_config
    cpu = config.offload_to_cpu
    dtypes = model._buffer_dtypes  # buffers held in MixedPrecision's buffer_dtype: their own

    def own(key: str, value: Any) -> Any:
        return value.to(dtypes[key]) if key in dtypes else value

    if model._sd_settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
        full = full_state_dict(model._units, model.module, lambda t: _to_dtensor(model, t, cpu))
        return {
            k: v if is_distributed(v) else _to_cpu(own(k, v.clone()), cpu) for k, v in full.items()
        }
    full = full_state_dict(model._units, model.module, keep_vars=keep_vars)
    full = {k: own(k, v) for k, v in full.items()}
    if _not_rank0(model, config):
        return {}
    return {key: _to_cpu(value, cpu) for key, value in full.items()}


def _optim_entries(
    model: FullyShardedDataParallel, optim: torch.optim.Optimizer, osd: dict[str, Any] | None
) -> list[tuple[int, str, ParamInfo | None, dict[str, Any]]]:
    """``optim_entries`` named as torch's state dicts are (checkpoint wrappers' parts dropped)."""
    entries = optim_entries(model._units, model._param_names(), optim, osd)
    clean = "_checkpoint_wrapped_module."
    return [(g, name.replace(clean, ""), info, state) for g, name, info, state in entries]


def _agree_mirrors(
    model: FullyShardedDataParallel, entries: list[tuple[Any, ...]]
) -> list[set[str]]:
    """Per entry, the state keys that mirror the parameter on some rank (checked on all)."""
    mine = [
        sorted(k for k, v in state.items() if mirrors(v, info)) for _, _, info, state in entries
    ]
    everyone = all_gather_objects(mine, model._groups.world)
    agreed = [set().union(*(row[i] for row in everyone)) for i in range(len(entries))]
    for (_, name, info, state), keys in zip(entries, agreed, strict=True):
        for key in keys:
            if not mirrors(state.get(key), info):
                raise ValueError(
                    f"optimizer state {name}.{key} mirrors the parameter on some ranks but not "
                    "on this one (missing, or not a 1-D tensor of this rank's length); step the "
                    "optimizer on every rank before saving its state"
                )
    return agreed


def _full_optim_tensors(
    model: FullyShardedDataParallel, entries: list[tuple[Any, ...]], keys: list[set[str]]
) -> dict[tuple[str, str], torch.Tensor]:
    """Every mirroring state tensor, unsharded: one all-gather per unit and key."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for unit in model._units:  # the same order on every rank
        mine = {id(info) for info in unit.infos}
        members = [i for i, e in enumerate(entries) if keys[i] and id(e[2]) in mine]
        for key in sorted({k for i in members for k in keys[i]}):
            holding = [i for i in members if key in keys[i]]
            pieces = [(entries[i][2], entries[i][3][key]) for i in holding]
            for i, full in zip(holding, _gather_params(unit, pieces), strict=True):
                out[(entries[i][1], key)] = full
    return out


def _gather_params(
    unit: FlatParamUnit, pieces: list[tuple[ParamInfo, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """Each piece's full tensor from every rank's slices (``None``: zeros); one all-gather."""
    dtype = next((t.dtype for _, t in pieces if t is not None), unit.dtype)
    local = torch.zeros(unit.shard_numel, dtype=dtype, device=unit.device)
    for info, piece in pieces:
        if piece is not None:
            local[info.shard_start : info.shard_start + info.length] = piece.reshape(-1)
    flat = gather_flat(unit, local)
    return [flat[i.offset : i.offset + i.numel].view(i.shape) for i, _ in pieces]


def optim_state_dict(
    model: FullyShardedDataParallel, optim: torch.optim.Optimizer, osd: dict[str, Any] | None
) -> dict[str, Any]:
    """``FSDP.optim_state_dict``: the optimizer state keyed by parameter name (collective)."""
    settings = model._sd_settings
    config = settings.optim_state_dict_config
    cpu = config.offload_to_cpu
    sharded = settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
    entries = _optim_entries(model, optim, osd)
    keys = _agree_mirrors(model, entries)
    full = _full_optim_tensors(model, entries, keys)
    if not sharded and _not_rank0(model, config):
        return {}
    state: dict[str, dict[str, Any]] = {}
    for i, (_, name, _, values) in enumerate(entries):
        if not values:
            continue
        entry = {}
        for key, value in values.items():
            if key in keys[i]:
                tensor = full[(name, key)]
                entry[key] = _to_dtensor(model, tensor, cpu) if sharded else _to_cpu(tensor, cpu)
            elif isinstance(value, torch.Tensor):
                entry[key] = _to_cpu(value.detach().clone(), cpu)
            else:
                entry[key] = value
        state[name] = entry
    source = osd["param_groups"] if osd is not None else optim.param_groups
    return {"state": state, "param_groups": groups_by_name(source, entries)}


# torch's optimizers keep these per-parameter states as 0-dim tensors whatever the parameter's
# shape (Adam and the others: step; ASGD: eta, mu)
_SCALAR_STATES = frozenset({"step", "eta", "mu"})


def _positional(key: str, value: torch.Tensor) -> bool:
    """Whether state ``key`` (shaped like its parameter) holds a value per element, which the
    rank's shard cuts: any tensor of 1 dim or more, and a 0-dim one of a 0-dim parameter unless
    it is one of torch's scalar states."""
    return value.dim() > 0 or key not in _SCALAR_STATES


def optim_state_dict_to_load(
    model: FullyShardedDataParallel, optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> dict[str, Any]:
    """``FSDP.optim_state_dict_to_load``: as this rank's ``optim.state_dict()`` (collective)."""
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
    entries = _optim_entries(model, optim, None)
    state: dict[int, dict[str, Any]] = {}
    for index, (_, name, info, _) in enumerate(entries):  # the same order on every rank
        saved = osd["state"].get(name)
        if saved is None:
            continue
        entry = {}
        for key in sorted(saved):
            value = full_tensor(saved[key]) if is_distributed(saved[key]) else saved[key]
            if isinstance(value, torch.Tensor):
                if info is not None and value.shape == info.shape and _positional(key, value):
                    value = value.reshape(-1)[info.param_start : info.param_start + info.length]
                value = value.clone()
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


def _broadcast_from_rank0(osd: Any, model: FullyShardedDataParallel) -> Any:
    """rank 0's ``osd`` on every rank: its structure (meta tensors) first, then each tensor."""
    group = model._groups.world
    src = dist.get_global_rank(group, 0)
    device = model._units[0].device
    sent: list[torch.Tensor] = []  # rank 0's tensors, in the order the structure holds them

    def strip(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        sent.append(value)
        return value.to("meta")

    holder = [tree_map(osd, strip) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(holder, src=src, group=group)
    pending = iter(sent)

    def fill(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        buffer = next(pending, None)  # None: a receiving rank
        if buffer is None:
            buffer = torch.empty(value.shape, dtype=value.dtype, device=device)
        buffer = buffer.to(device)
        dist.broadcast(buffer, src=src, group=group)
        return buffer

    return tree_map(holder[0], fill)


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
    exposed = rank0_only is False or group_rank(model._groups.world) == 0
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
        if wanted := [info for info in unit.infos if has[id(info)]]:
            pieces = [(info, info.sharded_param.grad) for info in wanted]
            for info, full in zip(wanted, _gather_params(unit, pieces), strict=True):
                out[id(info)] = full
    return out
