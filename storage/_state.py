"""Flatten a nested state into dotted names: tensor leaves (with a flat range) and JSON values."""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from ftsdp.storage._dtensor import dtensor_range, is_dtensor
from ftsdp.storage._dtypes import dtype_name
from ftsdp.storage._flat_shard import FlatShard
from ftsdp.storage._ranges import Range


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
    hint = None
    if type(obj) is FlatShard:  # global_shape is a tuple of ints already (__post_init__)
        # A FlatShard is frozen, so its leaf under the same name is the one made last time:
        # the engines hand the same shards to every save, and this walk runs on the caller's
        # thread (5 us a leaf saved, a third of the walk)
        kept = obj.__dict__.get("_leaf")
        if kept is not None and kept.name == name and kept.range.length == obj.local.numel():
            return kept
        local = obj.local
        dtype_name(local.dtype)  # raises for dtypes the format cannot hold
        leaf = TensorLeaf(
            name, obj.global_shape, local.dtype, Range(obj.offset, local.numel()), local, obj.layout
        )
        object.__setattr__(obj, "_leaf", leaf)
        return leaf
    elif isinstance(obj, FlatShard):
        shape, rng, local = obj.global_shape, Range(obj.offset, obj.length), obj.local
        shape, hint = tuple(int(d) for d in shape), obj.layout
    elif is_dtensor(obj):
        spec = getattr(obj, "_spec", None)
        kept_dt = _kept_dtensor_leaf(name, obj, spec)
        if kept_dt is not None:
            return kept_dt
        shape, rng, local = dtensor_range(name, obj)
        dtype_name(local.dtype)
        leaf = TensorLeaf(name, tuple(int(d) for d in shape), local.dtype, rng, local)
        key = id(obj)
        _DTENSOR_LEAVES[key] = (weakref.ref(obj, lambda _, k=key: _forget(k)), spec, leaf)
        return leaf
    else:
        shape, rng, local = tuple(obj.shape), Range(0, obj.numel()), obj
    dtype_name(local.dtype)  # raises for dtypes the format cannot hold
    return TensorLeaf(name, shape, local.dtype, rng, local, hint)


_TENSORS = (torch.Tensor, FlatShard)

# A DTensor's leaf, kept while the DTensor lives (by id, with a weak reference to tell it from a
# later object with the same id): its range costs several microseconds a leaf at every save
# (global shape, placements and mesh hashed), on the caller's thread. It is reused only under
# the same name while the DTensor keeps its spec and its local tensor (both are replaced, not
# changed, when a DTensor is redistributed or re-pointed). Unlike a FlatShard, a user's tensor
# gets no attribute of ours: ``torch.save`` would pickle it into their files.
_DTENSOR_LEAVES: dict[int, tuple[weakref.ref, Any, TensorLeaf]] = {}


def _kept_dtensor_leaf(name: str, dt: Any, spec: Any) -> TensorLeaf | None:
    kept = _DTENSOR_LEAVES.get(id(dt))
    if kept is None or spec is None:
        return None
    ref, kept_spec, leaf = kept
    same = ref() is dt and kept_spec is spec and leaf.name == name
    return leaf if same and leaf.local is getattr(dt, "_local_tensor", None) else None


def _forget(key: int) -> None:
    _DTENSOR_LEAVES.pop(key, None)


def flatten_state(state: Mapping) -> tuple[dict[str, TensorLeaf], dict[str, ValueLeaf]]:
    """Split ``state`` into tensor leaves and JSON value leaves keyed by dotted name.

    Mappings (str or int keys) and lists holding tensors are walked; any other leaf must be a
    tensor, a ``FlatShard``, a DTensor, or JSON-serialisable. Two paths that flatten to the same
    dotted name raise ``ValueError``.
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

    walk("", state)
    return tensors, values
