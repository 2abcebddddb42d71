"""Flatten a nested state into dotted names: tensor leaves (with a flat range) and JSON values."""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ftsdp.storage.format._dtensor import dtensor_range, is_dtensor
from ftsdp.storage.format._dtypes import dtype_name
from ftsdp.storage.format._flat_shard import FlatShard
from ftsdp.storage.format._ranges import Range


@dataclass(slots=True)
class TensorLeaf:
    """One tensor of the state as this rank holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    range: Range  # the elements of the global tensor this rank holds
    local: torch.Tensor  # numel == range.length, values in row-major order
    layout: tuple[int, int] | None = None  # FlatShard.layout: (start, chunk) of an even split

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ValueLeaf:
    """A JSON-able leaf and where it lives, so that ``load`` can replace it in place."""

    name: str
    value: Any
    parent: MutableMapping | list
    key: Any


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, FlatShard)):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def _tensor_leaf(name: str, obj: Any) -> TensorLeaf:
    # see [Note: leaves kept between saves]
    token = _token(obj)
    if token is not None:
        kept = _kept.get(id(obj))
        if kept is not None and kept[0]() is obj and kept[2].name == name:
            (a, b), leaf = kept[1], kept[2]
            if a is token[0] and b is token[1] and leaf.range.length == leaf.local.numel():
                return leaf  # (a resize_ since: made anew)
    leaf = _new_leaf(name, obj)
    if token is not None:
        key = id(obj)
        _kept[key] = (weakref.ref(obj, lambda _: _kept.pop(key, None)), token, leaf)
    return leaf


def _new_leaf(name: str, obj: Any) -> TensorLeaf:
    hint = None
    if type(obj) is FlatShard:  # global_shape is a tuple of ints already (__post_init__)
        shape, rng, local = obj.global_shape, Range(obj.offset, obj.local.numel()), obj.local
        hint = obj.layout
    elif isinstance(obj, FlatShard):
        shape, rng, local = obj.global_shape, Range(obj.offset, obj.length), obj.local
        shape, hint = tuple(int(d) for d in shape), obj.layout
    elif is_dtensor(obj):
        shape, rng, local = dtensor_range(name, obj)
        shape = tuple(int(d) for d in shape)
    else:
        shape, rng, local = tuple(obj.shape), Range(0, obj.numel()), obj
    dtype_name(local.dtype)  # raises for dtypes the format cannot hold
    return TensorLeaf(name, shape, local.dtype, rng, local, hint)


_TENSORS = (torch.Tensor, FlatShard)

# [Note: leaves kept between saves]
# The engines hand the same FlatShards and DTensors to every save, and this walk runs on the
# caller's thread: making a leaf costs 5 us (a FlatShard) to 8 us (a DTensor's range: global
# shape, placements and mesh hashed), a third to a half of the walk. So a leaf is kept while its
# object lives (by id, with a weak reference that drops the entry when the object dies and
# tells it from a later one with the same id) and reused under the same name while the object
# still holds the same local tensor of the same size: ``_token`` is what must stay the same
# object (a frozen FlatShard never changes; a DTensor's spec and local tensor are replaced,
# not changed, when it is redistributed or re-pointed). Nothing is set on the objects
# themselves: ``torch.save`` would pickle it into a user's files.
_kept: dict[int, tuple[weakref.ref, tuple[Any, Any], TensorLeaf]] = {}


def _token(obj: Any) -> tuple[Any, Any] | None:
    """The two objects that must stay the same for ``obj``'s kept leaf to hold; None: never
    kept (a plain tensor's leaf costs nothing to make)."""
    if type(obj) is FlatShard:
        return obj.local, None
    if type(obj) is not torch.Tensor and is_dtensor(obj):
        spec, local = getattr(obj, "_spec", None), getattr(obj, "_local_tensor", None)
        if spec is not None and local is not None:
            return spec, local
    return None


class KeptState(Mapping[str, Any]):
    """A read-only part of a state that its owner hands to save after save while nothing in it
    changed: ``flatten_state`` walks it once and takes its leaves from that walk whenever the
    same object comes back (see [Note: kept parts of a state]).

    The contract is the owner's: pass a new ``KeptState`` whenever anything in it changed (a
    tensor replaced, resized or re-pointed, a value changed), never change what one holds.
    ``CheckpointManager`` makes one for the model and one for the optimizer state when their
    tensors are the same objects at the same addresses as at the last save. For saving only:
    ``load`` puts values into the mappings it is given, which a ``KeptState`` refuses."""

    __slots__ = ("__weakref__", "_data")

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"KeptState({self._data!r})"


# [Note: kept parts of a state]
# Most of what a training loop saves is the same from save to save: the model's and the
# optimizer's tensors, replaced only when the model is rebuilt or the optimizer state is loaded.
# Their owner (CheckpointManager's engine) knows that from its own checks, and walking a few
# hundred leaves again costs about a millisecond of the caller's blocking time at every save.
# So a ``KeptState`` is walked once; its leaves are kept (by id, with a weak reference that
# drops them when it dies and tells it from a later object with the same id) under the dotted
# name it was found at, and a later walk that meets the same object at the same name takes
# them as they are. Only the names are checked again (two entries of the state that flatten to
# one name still raise). The values among them are JSON already checked by the first walk.
_walked: dict[int, tuple[weakref.ref, str, dict[str, TensorLeaf], dict[str, ValueLeaf]]] = {}


def flatten_state(state: Mapping) -> tuple[dict[str, TensorLeaf], dict[str, ValueLeaf]]:
    """Split ``state`` into tensor leaves and JSON value leaves keyed by dotted name.

    Mappings (str or int keys) and lists holding tensors are walked; any other leaf must be a
    tensor, a ``FlatShard``, a DTensor, or JSON-serialisable. Two paths that flatten to the same
    dotted name raise ``ValueError``. A ``KeptState`` met again is not walked again.
    """
    # It runs on the caller's thread at every save (a few hundred leaves): kept to one function
    # call per mapping or list, the leaves' checks inline.
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    tensors: dict[str, TensorLeaf] = {}
    values: dict[str, ValueLeaf] = {}

    def walk(prefix: str, obj: Any) -> None:
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for key, child in items:
            if type(key) is not str and (not isinstance(key, (str, int)) or isinstance(key, bool)):
                raise TypeError(f"{prefix or '<root>'}: key {key!r} must be a str or int")
            name = f"{prefix}.{key}" if prefix else str(key)
            if name in tensors or name in values:
                raise ValueError(f"two entries of the state flatten to the same name {name!r}")
            if isinstance(child, _TENSORS):
                tensors[name] = _tensor_leaf(name, child)
            elif type(child) is KeptState:
                kept(name, child)
            elif isinstance(child, Mapping) or (isinstance(child, list) and _has_tensor(child)):
                walk(name, child)
            elif isinstance(child, tuple) and _has_tensor(child):
                raise TypeError(f"{name}: tuples holding tensors are not supported; use a list")
            else:
                try:
                    json.dumps(child)
                except (TypeError, ValueError) as e:
                    raise TypeError(
                        f"{name}: value of type {type(child).__name__} is neither a tensor nor "
                        f"JSON-serialisable ({e}); convert it before saving"
                    ) from e
                values[name] = ValueLeaf(name, child, obj, key)

    def kept(name: str, part: KeptState) -> None:
        # see [Note: kept parts of a state]
        hit = _walked.get(id(part))
        if hit is None or hit[0]() is not part or hit[1] != name:
            before_t, before_v = set(tensors), set(values)
            walk(name, part)
            own_t = {n: t for n, t in tensors.items() if n not in before_t}
            own_v = {n: v for n, v in values.items() if n not in before_v}
            key = id(part)
            ref = weakref.ref(part, lambda _: _walked.pop(key, None))
            _walked[key] = (ref, name, own_t, own_v)
            return
        own_t, own_v = hit[2], hit[3]
        for mine in (own_t, own_v):
            for theirs in (tensors, values):
                if not theirs.keys().isdisjoint(mine):
                    clash = min(theirs.keys() & mine.keys())
                    raise ValueError(f"two entries of the state flatten to the same name {clash!r}")
        tensors.update(own_t)
        values.update(own_v)

    walk("", state)
    return tensors, values
