"""Engine adapters: any engine's model and optimizer state (docs/elastic.md, "Any engine")."""

from __future__ import annotations

import abc
import json
import operator
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ftsdp import storage

if TYPE_CHECKING:
    from ftsdp.fsdp import FullyShardedDataParallel


class Engine(abc.ABC):
    """How one kind of model hands its state to storage (leaves aliasing live tensors) and back."""

    kind = "module"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        # reused between saves while no tensor was replaced: (key, leaves), (key, groups, leaves)
        self._model_cache: tuple[Any, dict[str, Any]] | None = None
        self._optim_cache: tuple[Any, list, dict[str, dict[str, Any]]] | None = None
        # a new number whenever leaves are made afresh: the same number, the same leaves
        self.generation = 0
        self._held: tuple[int, dict[str, Any], dict[str, dict[str, Any]]] | None = None

    @abc.abstractmethod
    def _model_state(self) -> dict[str, Any]:
        """``{name: leaf}`` for every parameter and persistent buffer."""

    @abc.abstractmethod
    def _raw_optim(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """``(state by parameter name, param groups naming their parameters)``."""

    @abc.abstractmethod
    def _leaf(self, name: str, key: str, value: Any, param: torch.Tensor) -> Any:
        """One optimizer state value of ``param`` as a storage leaf (raise: not reshardable)."""

    @abc.abstractmethod
    def load(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        """Put the state ``storage.load`` filled into the live model and optimizer."""

    def model_state(self) -> dict[str, Any]:
        """``{name: leaf}`` of every parameter and persistent buffer (leaves reused: unchanged)."""
        state, kept = self._model_leaves()
        return dict(state) if kept else state

    def _model_leaves(self) -> tuple[dict[str, Any], bool]:
        """``{name: leaf}`` and whether it is the kept dict (then read only)."""
        tensors = _module_tensors(self.model)
        key = _identities(tensors)
        if self._model_cache is not None and self._model_cache[0] == key:
            return self._model_cache[1], True
        self.generation += 1
        state = self._model_state()
        # Kept only while every leaf lies in a parameter's or buffer's memory, which the key
        # watches: extra state (a value, or a tensor a hook makes anew at every call) may change
        # without any of them changing.
        if not _within(state.values(), tensors):
            self._model_cache = None
            return state, False
        self._model_cache = (key, state)
        return state, True

    def tensor_leaves(self) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]], str]:
        """``(generation, model leaves, optimizer state leaves by parameter, param groups as
        JSON)``, the leaves read only: the same generation, the same leaves (docs/elastic.md,
        "Saves that do not stop training"); the param groups are read at every call."""
        model, _ = self._model_leaves()
        optim, groups = self._optim()
        return self.generation, model, optim, groups_json(groups)

    def _rank0_only(
        self,
        generation: int,
        model: dict[str, Any],
        optim: dict[str, dict[str, Any]],
        choose: Callable[[], tuple[list[str], list[tuple[str, str]]]],
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """``model`` and ``optim`` with the leaves ``choose()`` names (model leaves, optimizer
        values ``(param, key)``) as empty shards, so that only rank 0 saves them; chosen once
        per generation."""
        if self._held is None or self._held[0] != generation:

            def held(t: Any) -> storage.FlatShard:
                if isinstance(t, storage.FlatShard):
                    return storage.FlatShard(t.global_shape, 0, t.local[:0])
                return storage.FlatShard(tuple(t.shape), 0, t.reshape(-1)[:0])

            names, optim_names = choose()
            new_optim = {name: dict(entry) for name, entry in optim.items()}
            for name, key in optim_names:
                new_optim[name][key] = held(optim[name][key])
            self._held = (generation, {**model, **{n: held(model[n]) for n in names}}, new_optim)
        return self._held[1], self._held[2]

    def buffer_leaves(self, state: Mapping[str, Any]) -> list[str]:
        """The names of ``state``'s leaves that hold one of the model's buffers (``forward`` may
        change buffers in place; the fence holds back only the optimizer)."""
        buffers = {
            _memory(b)
            for module in self.model.modules()
            for b in module._buffers.values()
            if b is not None and b.numel()
        }
        if not buffers:
            return []
        names = []
        for name, leaf in state.items():
            local = leaf.local if isinstance(leaf, storage.FlatShard) else leaf
            if isinstance(local, torch.Tensor) and local.numel() and _memory(local) in buffers:
                names.append(name)
        return names

    def copy_buffers(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        """``state`` with every leaf holding one of the model's buffers replaced by a copy taken
        now (:meth:`buffer_leaves`)."""
        copies = {}
        for name in self.buffer_leaves(state):
            leaf = state[name]
            if isinstance(leaf, storage.FlatShard):
                copies[name] = replace(leaf, local=leaf.local.clone())
            else:
                copies[name] = leaf.detach().clone()
        return {**state, **copies} if copies else state

    def _optim(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        """``(leaves by name, param groups)``; leaves cached while no state was replaced."""
        key = _optim_identities(self.optimizer)
        cached = self._optim_cache
        if key is not None and cached is not None and cached[0] == key:
            groups = [
                {**{k: v for k, v in live.items() if k != "params"}, "params": names["params"]}
                for live, names in zip(self.optimizer.param_groups, cached[1], strict=True)
            ]
            return cached[2], groups
        self.generation += 1
        state, groups = self._raw_optim()
        params = self._params(groups)
        leaves = {
            name: {k: self._leaf(name, k, value, params[name]) for k, value in entry.items()}
            for name, entry in state.items()
        }
        self._optim_cache = None if key is None else (key, groups, leaves)
        return leaves, groups

    def optim_state(self) -> dict[str, Any]:
        """``{"state": {param: {key: leaf}}, "param_groups": json}``, dicts of its own."""
        leaves, groups = self._optim()
        return {
            "state": {name: dict(entry) for name, entry in leaves.items()},
            "param_groups": groups_json(groups),
        }

    def params_by_name(self) -> dict[str, torch.Tensor]:
        """The optimizer's parameters under the names its state is saved with."""
        return self._params(self._optim()[1])

    def _params(self, groups: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for saved, group in zip(groups, self.optimizer.param_groups, strict=True):
            out.update(zip(saved["params"], group["params"], strict=True))
        return out


def _json_value(what: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"CheckpointManager: {what} is a {type(value).__name__}, neither a tensor nor "
            f"JSON-serialisable ({e}); only tensors and JSON values can be checkpointed"
        ) from e
    return value


def _plain(value: Any) -> Any:
    """``value`` with its tensors as numbers (or lists) and its tuples as lists."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value


def _like(saved: Any, current: Any) -> Any:
    """``saved`` (JSON) with a tensor wherever ``current`` (the live state) holds one."""
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, dict) and isinstance(saved, dict):
        return {k: _like(v, current[k]) if k in current else v for k, v in saved.items()}
    if isinstance(current, list | tuple) and isinstance(saved, list) and len(saved) == len(current):
        return type(current)(_like(s, c) for s, c in zip(saved, current, strict=True))
    return saved


def scheduler_json(state: dict[str, Any]) -> str:
    """An LR scheduler's state dict as one JSON string: its tensors (a tensor learning rate's
    ``base_lrs`` and ``_last_lr``) become numbers; anything else that is not JSON is named."""
    try:
        return json.dumps(_plain(state), sort_keys=True)
    except (TypeError, ValueError):
        for key, value in state.items():
            _json_value(f"lr_scheduler state {key!r}", _plain(value))
        raise


def scheduler_state(saved_json: str, current: dict[str, Any]) -> dict[str, Any]:
    """The saved scheduler state, with tensors again where the live scheduler holds them."""
    return _like(json.loads(saved_json), current)


def groups_json(groups: list[dict[str, Any]]) -> str:
    """Param groups as one JSON string: tensors become numbers (or lists), tuples lists."""
    doc = [{k: (v if k == "params" else _plain(v)) for k, v in g.items()} for g in groups]
    try:
        return json.dumps(doc, sort_keys=True)
    except (TypeError, ValueError):  # name the value (checked only now: this runs every save)
        for group in doc:
            for key, value in group.items():
                _json_value(f"param group value {key!r}", value)
        raise


def _not_reshardable(name: str, key: str, value: torch.Tensor, expected: str) -> ValueError:
    return ValueError(
        f"CheckpointManager: optimizer state {name}.{key} is a tensor of shape "
        f"{tuple(value.shape)}, neither 0-dim nor {expected}, so it cannot be resharded to "
        "another world size. Only element-wise optimizers (state per element of the parameter, "
        "or scalars) can be checkpointed with this engine"
    )


class FtsdpEngine(Engine):
    """``ftsdp.FSDP``: every view of the engine's flat shards becomes a ``FlatShard``."""

    kind = "ftsdp"
    model: FullyShardedDataParallel

    def _model_state(self) -> dict[str, Any]:
        return {name: _flat(view) for name, view in self.model.sharded_state_dict().items()}

    def tensor_leaves(self) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]], str]:
        """As :meth:`Engine.tensor_leaves`; what the engine does not shard (buffers, ignored
        parameters and their optimizer state) from rank 0 only (docs/elastic.md, "Any engine")."""
        generation, model, optim, groups = super().tensor_leaves()
        if not dist.is_initialized() or dist.get_rank() == 0:
            return generation, model, optim, groups

        def whole() -> tuple[list[str], list[tuple[str, str]]]:
            names = [  # in no unit's range (layout None): a buffer, an ignored parameter
                n
                for n, v in model.items()
                if isinstance(v, storage.FlatShard) and v.layout is None and v.local.numel()
            ]
            values = [
                (name, key)
                for name, entry in optim.items()
                for key, v in entry.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ]
            return names, values

        model, optim = self._rank0_only(generation, model, optim, whole)
        return generation, model, optim, groups

    def _raw_optim(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        sd = self.model.sharded_optim_state_dict(self.optimizer)
        return sd["state"], sd["param_groups"]

    def _leaf(self, name: str, key: str, value: Any, param: torch.Tensor) -> Any:
        if hasattr(value, "global_shape"):  # a ShardView: the parameter's range
            return _flat(value)
        if isinstance(value, torch.Tensor):
            # 0-dim, or shaped like a parameter the engine does not shard (ignored_modules):
            # whole, like that parameter in model_state
            if value.dim() == 0 or value.shape == param.shape:
                return value
            raise _not_reshardable(name, key, value, "1-D with the parameter's local numel")
        return _json_value(f"optimizer state {name}.{key}", value)

    def load(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        params = self.params_by_name()  # every tensor was loaded in place: the JSON values
        for name, entry in optim_state["state"].items():
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor | storage.FlatShard):
                    self.optimizer.state[params[name]][key] = value


def _flat(view: Any) -> storage.FlatShard:
    return storage.FlatShard(
        tuple(view.global_shape), view.offset, view.local, getattr(view, "layout", None)
    )


def _is_dtensor(value: Any) -> bool:
    # No DTensor exists before its module is imported: no import here (it runs per tensor).
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


class TorchEngine(Engine):
    """FSDP2 / DTensor models, DDP and plain modules, through torch's DCP ``state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, kind: str) -> None:
        super().__init__(model, optimizer)
        self.kind = kind
        from torch.distributed.checkpoint import state_dict as dsd

        self._dsd = dsd

    def tensor_leaves(self) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]], str]:
        """As :meth:`Engine.tensor_leaves`; under DDP the buffers from DDP's rank 0 only, whose
        buffers DDP broadcasts before each forward (docs/elastic.md, "Any engine")."""
        generation, model, optim, groups = super().tensor_leaves()
        if self.kind != "ddp" or not dist.is_initialized():
            return generation, model, optim, groups
        if dist.get_rank(getattr(self.model, "process_group", None)) == 0:
            return generation, model, optim, groups
        model, optim = self._rank0_only(
            generation, model, optim, lambda: (self.buffer_leaves(model), [])
        )
        return generation, model, optim, groups

    def _model_state(self) -> dict[str, Any]:
        state = self._dsd.get_model_state_dict(self.model)
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                _check_tensor(f"model.{name}", value)
            else:
                _json_value(f"model state {name}", value)
        return state

    def _raw_optim(self) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
        # get_optimizer_state_dict creates the state when there is none (one step with zero
        # gradients and lr 0): a save must not change the optimizer, so undo it then.
        empty = not self.optimizer.state
        # torch types each entry as either shape; "state" is a dict, "param_groups" a list
        sd: dict[str, Any] = self._dsd.get_optimizer_state_dict(self.model, self.optimizer)
        if empty:
            self.optimizer.state.clear()
        return ({} if empty else sd["state"]), sd["param_groups"]

    def _leaf(self, name: str, key: str, value: Any, param: torch.Tensor) -> Any:
        if isinstance(value, torch.Tensor):
            if _is_dtensor(param) and not _is_dtensor(value) and value.dim() > 0:
                raise _not_reshardable(name, key, value, "a DTensor like its parameter")
            return _check_tensor(f"optim.state.{name}.{key}", value)
        return _json_value(f"optimizer state {name}.{key}", value)

    def load(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        dsd = self._dsd
        dsd.set_model_state_dict(self.model, model_state)
        groups = dsd.get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        dsd.set_optimizer_state_dict(
            self.model,
            self.optimizer,
            {"state": optim_state["state"], "param_groups": groups},
            # the names were checked against the checkpoint by storage.load already; a parameter
            # without saved state (no step had reached it) stays without state
            options=dsd.StateDictOptions(strict=False),
        )


def _identities(tensors: list[torch.Tensor]) -> tuple[list[Any], ...]:
    """Of each tensor (a DTensor: of its local shard too): identity, memory, shape, strides and
    dtype, as columns made by C-level maps (this runs at every save)."""
    local = tensors
    if not _PLAIN_TYPES.issuperset(map(type, tensors)):
        local = [t if type(t) in _PLAIN else getattr(t, "_local_tensor", t) for t in tensors]
    return (
        list(map(id, tensors)),
        list(map(id, local)),
        list(map(torch.Tensor.data_ptr, local)),
        list(map(_SHAPE, local)),
        list(map(torch.Tensor.stride, local)),
        list(map(_DTYPE, local)),
    )


def _memory(t: torch.Tensor) -> int:
    """Where ``t``'s storage (a DTensor's: its local shard's) starts."""
    return int(getattr(t, "_local_tensor", t).untyped_storage().data_ptr())


def _within(leaves: Any, tensors: list[torch.Tensor]) -> bool:
    """Whether every leaf is a tensor or ``FlatShard`` in the memory of one of ``tensors``."""
    memory = set(map(_memory, tensors))
    for leaf in leaves:
        local = leaf.local if isinstance(leaf, storage.FlatShard) else leaf
        if not isinstance(local, torch.Tensor) or (local.numel() and _memory(local) not in memory):
            return False
    return True


_PLAIN = (torch.Tensor, nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_OWN_ANSWERS = ("parameters", "named_parameters", "buffers", "named_buffers")


def _module_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer (per module holding it); ``ftsdp.FSDP`` is asked for its own."""
    cls = type(model)
    if any(getattr(cls, name) is not getattr(nn.Module, name) for name in _OWN_ANSWERS):
        return [*model.parameters(), *model.buffers()]
    out: list[torch.Tensor] = []
    for module in model.modules():
        out.extend(t for t in module._parameters.values() if t is not None)
        out.extend(t for t in module._buffers.values() if t is not None)
    return out


def _optim_identities(optimizer: torch.optim.Optimizer) -> tuple[Any, ...] | None:
    """What makes a cached optimizer state dict stale; None: do not cache (no state yet)."""
    if not optimizer.state:
        return None
    structure: list[Any] = [list(map(id, g["params"])) for g in optimizer.param_groups]
    tensors: list[torch.Tensor] = []
    for p, entry in optimizer.state.items():
        keys: list[Any] = []
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors.append(v)
                keys.append(k)
            else:
                keys.append((k, repr(v)))
        structure.append((id(p), keys))
    return structure, _identities(tensors)


def _check_tensor(name: str, value: torch.Tensor) -> torch.Tensor:
    if not _is_dtensor(value) and hasattr(value, "local_shards"):
        raise TypeError(
            f"CheckpointManager: {name} is a {type(value).__name__}; only plain tensors and "
            "DTensors can be checkpointed (torch FSDP1's ShardedTensor is not supported: use "
            "FSDP2's fully_shard or ftsdp.FSDP)"
        )
    return value


def engine_for(model: nn.Module, optimizer: torch.optim.Optimizer) -> Engine:
    """The adapter for ``model``; raises for what no adapter handles, naming it."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"CheckpointManager: model must be an nn.Module, got {type(model).__name__}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "CheckpointManager: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if hasattr(model, "sharded_state_dict") and hasattr(model, "sharded_optim_state_dict"):
        return FtsdpEngine(model, optimizer)
    if any(hasattr(m, "sharded_optim_state_dict") for m in model.modules()):
        raise TypeError(
            "CheckpointManager: the model holds an ftsdp.FSDP wrapper inside another module; "
            "pass the wrapper itself (its optimizer state is sharded, which only the wrapper "
            "saves and loads correctly), and save the other modules' state beside it"
        )
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "CheckpointManager does not support torch FSDP1 (FullyShardedDataParallel): use "
            "FSDP2 (torch.distributed.fsdp.fully_shard) or ftsdp.FSDP"
        )
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "CheckpointManager: the optimizer holds a parameter that is not one of the "
            "model's; create the optimizer from model.parameters() after wrapping"
        )
    if any(_is_dtensor(p) for p in model.parameters()):
        return TorchEngine(model, optimizer, "dtensor")
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    return TorchEngine(model, optimizer, "ddp" if ddp else "module")
