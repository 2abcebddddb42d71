"""A wrapped model's state as plain data: full state dicts and ShardViews (docs/design.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._collectives import all_gather_flat, comm_device
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
) -> dict[str, Any]:
    """The unwrapped module's state, full parameters gathered a unit at a time (collective)."""
    full_params: dict[int, Any] = {}
    for unit in units:
        if unit.infos:
            flat = gather_flat(unit, unit.on_device(unit.shard))
            for info in unit.infos:
                full = flat[info.offset : info.offset + info.numel].view(info.shape)
                full_params[id(info)] = convert(full)
    state = module.state_dict(keep_vars=True)
    index = state_index(units, state)
    return {
        key: full_params[id(index[key])] if key in index else value.detach()
        for key, value in state.items()
    }


def load_full_state_dict(
    units: list[FlatParamUnit], module: nn.Module, state: dict[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """Copy this rank's slice of full tensors (or DTensors / ShardedTensors) into the shards,
    only once every check passed; returns (missing, unexpected)."""
    expected = module.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if strict and (missing or unexpected):
        raise ValueError(
            f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}; "
            "pass strict=False to load the keys that match"
        )
    index = state_index(units, expected)
    present = [(key, current, state[key]) for key, current in expected.items() if key in state]
    for key, current, value in present:
        shape = index[key].shape if key in index else current.shape
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
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
