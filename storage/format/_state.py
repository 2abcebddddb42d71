"""Flatten a nested state into dotted names: tensor leaves (with a flat range) and JSON values."""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
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


@dataclass
class ValueLeaf:
    """A JSON-able leaf and where it lives, so that ``load`` can replace it in place."""

    name: str
    value: Any
    parent: MutableMapping | list
    key: Any


_TENSORS = (torch.Tensor, FlatShard)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    return isinstance(obj, _TENSORS) or (
        isinstance(obj, (list, tuple)) and any(map(_has_tensor, obj))
    )


def _tensor_leaf(name: str, obj: Any) -> TensorLeaf:
    hint = None
    if isinstance(obj, FlatShard):  # (a subclass may override global_shape and length)
        shape, rng, local = obj.global_shape, Range(obj.offset, obj.length), obj.local
        shape, hint = tuple(int(d) for d in shape), obj.layout
    elif is_dtensor(obj):
        shape, rng, local = dtensor_range(name, obj)
        shape = tuple(int(d) for d in shape)
    else:
        shape, rng, local = tuple(obj.shape), Range(0, obj.numel()), obj
    dtype_name(local.dtype)  # raises for dtypes the format cannot hold
    return TensorLeaf(name, shape, local.dtype, rng, local, hint)


def flatten_state(state: Mapping) -> tuple[dict[str, TensorLeaf], dict[str, ValueLeaf]]:
    """Split ``state`` into tensor leaves and JSON value leaves keyed by dotted name.

    Mappings (str or int keys) and lists holding tensors are walked; any other leaf must be a
    tensor, a ``FlatShard``, a DTensor, or JSON-serialisable. Two paths that flatten to the same
    dotted name raise ``ValueError``.
    """
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
