"""Flatten a nested state into dotted names: tensor leaves (with a flat range: a ``FlatShard``, a
DTensor's shard in its grid order) and JSON values."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ftsdp.storage.format._dtypes import dtype_name
from ftsdp.storage.format._grid import Box, Cuts, box_range, dtensor_grid, is_plain
from ftsdp.storage.format._ranges import Range


@dataclass(frozen=True)
class FlatShard:
    """Elements ``[offset, offset + local.numel())`` of the row-major flattening of a tensor of
    ``global_shape``; ``local`` (1-D, any device) is what this rank holds: ``save`` reads it,
    ``load`` fills it in place. ``layout``, optional: ``(start, chunk)`` of an ``even`` rule (a
    FlatParameter's offset in its unit's buffer and the shard size, checked against the ranges;
    docs/format.md, "Tensors described by a rule")."""

    global_shape: tuple[int, ...]
    offset: int
    local: torch.Tensor  # 1-D, numel = this rank's length
    layout: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.global_shape)
        object.__setattr__(self, "global_shape", shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"FlatShard: global_shape={shape} has a negative dimension")
        if not isinstance(self.local, torch.Tensor) or self.local.dim() != 1:
            raise ValueError(
                "FlatShard: local must be a 1-D torch.Tensor, got "
                f"{type(self.local).__name__} of shape {getattr(self.local, 'shape', None)}"
            )
        numel = math.prod(shape)
        if self.layout is not None:
            start, chunk = (int(v) for v in self.layout)
            if start < 0 or chunk < 1:
                raise ValueError(
                    f"FlatShard: layout={self.layout} must be (start >= 0, chunk >= 1)"
                )
            object.__setattr__(self, "layout", (start, chunk))
        if self.offset < 0 or self.offset + self.local.numel() > numel:
            raise ValueError(
                f"FlatShard: offset={self.offset} length={self.local.numel()} does not fit in "
                f"global_shape={shape} ({numel} elements)"
            )

    @property
    def length(self) -> int:
        """Number of elements this rank holds."""
        return self.local.numel()


def is_dtensor(obj: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (never imports it: none exists before)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def dtensor_leaf(
    name: str, dt: Any, memo: dict
) -> tuple[tuple[int, ...], Range, torch.Tensor, Cuts | None, Box | None]:
    """``(global shape, range, local tensor, grid, box)`` of this rank's shard of DTensor ``dt``:
    any mix of ``Shard(d)``, ``_StridedShard`` and ``Replicate`` whose shards are boxes. The range
    is in the grid order of the shards (docs/format.md, "Tensors saved on a grid"); grid and box
    are None when that order is the row-major one. ``memo`` keeps grids by layout for one walk."""
    shape = tuple(int(d) for d in dt.shape)
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"{name}: this rank is not in the DTensor's device mesh")
    key = (shape, tuple(mesh.shape), tuple(coordinate), tuple(dt.placements))
    hit = memo.get(key)
    if hit is None:
        try:
            hit = memo[key] = dtensor_grid(shape, mesh.shape, coordinate, dt.placements)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
    box, cuts = hit
    local = getattr(dt, "_local_tensor", None)  # to_local() goes through autograd
    local = local if isinstance(local, torch.Tensor) else dt.to_local()
    grid = None if is_plain(cuts, shape) else cuts  # every rank names the same one, empty too
    if box.numel == 0:
        return shape, Range(0, 0), local, grid, None
    start, length = box_range(cuts, shape, box)
    return shape, Range(start, length), local, grid, None if grid is None else box


@dataclass(slots=True)
class TensorLeaf:
    """One tensor of the state as this rank holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    range: Range  # the elements of the global tensor this rank holds
    local: torch.Tensor  # numel == range.length, values in row-major order
    layout: tuple[int, int] | None = None  # FlatShard.layout: (start, chunk) of an even split
    grid: Cuts | None = None  # the cuts whose grid order ``range`` is in; None: row-major
    box: Box | None = None  # with a grid: the box of the tensor this rank holds


@dataclass
class ValueLeaf:
    """A JSON-able leaf and where it lives, so that ``load`` can replace it in place."""

    name: str
    value: Any
    parent: MutableMapping | list
    key: Any


_TENSORS = (torch.Tensor, FlatShard)
_SCALARS = frozenset({str, int, float, bool, type(None)})  # exactly these types, not subclasses


def json_copy(values: Mapping[str, ValueLeaf]) -> dict[str, Any]:
    """The leaves' values by name, as JSON would give them back (what a save records: a value
    changed after the call is not seen); str, int, float, bool and None are taken as they are,
    since JSON gives back an equal one of the same type."""
    return {
        n: v.value if type(v.value) in _SCALARS else json.loads(json.dumps(v.value))
        for n, v in values.items()
    }


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    return isinstance(obj, _TENSORS) or (
        isinstance(obj, (list, tuple)) and any(map(_has_tensor, obj))
    )


def _tensor_leaf(name: str, obj: Any, memo: dict) -> TensorLeaf:
    hint, grid, box = None, None, None
    if isinstance(obj, FlatShard):  # (a subclass may override global_shape and length)
        shape, rng, local = obj.global_shape, Range(obj.offset, obj.length), obj.local
        shape, hint = tuple(int(d) for d in shape), obj.layout
    elif is_dtensor(obj):
        shape, rng, local, grid, box = dtensor_leaf(name, obj, memo)
    else:
        shape, rng, local = tuple(obj.shape), Range(0, obj.numel()), obj
    dtype_name(local.dtype)  # raises for dtypes the format cannot hold
    if local.is_conj() or local.is_neg():  # a view whose bit torch applies when it is read
        local = local.resolve_conj().resolve_neg()  # its values, copied now
    return TensorLeaf(name, shape, local.dtype, rng, local, hint, grid, box)


@dataclass(frozen=True, eq=False)  # (compared by identity: its leaves hold tensors)
class WalkedPart:
    """A part of a state flattened before (:func:`walk_part`), put back in its place in a state:
    :func:`flatten_state` takes its leaves as they are instead of walking the part again. Its
    names are full names, so it belongs at the place it was walked for (``prefix``). Whoever
    keeps one from a save to the next vouches that the part is still what it was: the same
    tensors with the same storage, shape and dtype, and the same values."""

    prefix: str
    tensors: Mapping[str, TensorLeaf]
    values: Mapping[str, ValueLeaf]

    def with_locals(self, locals_: Mapping[str, torch.Tensor]) -> WalkedPart:
        """A copy whose leaves named in ``locals_`` hold those tensors instead (same shape and
        dtype: copies of the kept ones, e.g. buffers that change in ``forward``)."""
        tensors = dict(self.tensors)
        for name, local in locals_.items():
            leaf = tensors[name]
            if local.shape != leaf.local.shape or local.dtype != leaf.dtype:
                raise ValueError(
                    f"{name}: a replacement of {tuple(local.shape)} {local.dtype} for a leaf of "
                    f"{tuple(leaf.local.shape)} {leaf.dtype}"
                )
            tensors[name] = replace(leaf, local=local)
        return WalkedPart(self.prefix, tensors, self.values)


def walk_part(part: Mapping, prefix: str) -> WalkedPart:
    """``part`` flattened for its place ``prefix`` (a dotted name) in a state, to be kept."""
    if not prefix:
        raise ValueError("walk_part: the prefix must name the part's place (a non-empty name)")
    if not isinstance(part, Mapping):
        raise TypeError(f"{prefix}: a walked part must be a mapping, got {type(part).__name__}")
    tensors: dict[str, TensorLeaf] = {}
    values: dict[str, ValueLeaf] = {}
    _walk(prefix, part, tensors, values, {})
    return WalkedPart(prefix, tensors, values)


def flatten_state(state: Mapping) -> tuple[dict[str, TensorLeaf], dict[str, ValueLeaf]]:
    """Tensor leaves (tensors, ``FlatShard``s, DTensors) and JSON value leaves of ``state`` by
    dotted name, walking mappings (str or int keys) and lists holding tensors, and taking a
    ``WalkedPart``'s leaves as they are; TypeError for another leaf, ValueError when two paths
    flatten to one name."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping, got {type(state).__name__}")
    tensors: dict[str, TensorLeaf] = {}
    values: dict[str, ValueLeaf] = {}
    # memo: DTensor grids by layout, for one walk (the layers of a model and their states share them)
    _walk("", state, tensors, values, {})
    return tensors, values


def _walk(
    prefix: str,
    obj: Any,
    tensors: dict[str, TensorLeaf],
    values: dict[str, ValueLeaf],
    memo: dict,
) -> None:
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
    for key, child in items:
        if type(key) is not str and (not isinstance(key, (str, int)) or isinstance(key, bool)):
            raise TypeError(f"{prefix or '<root>'}: key {key!r} must be a str or int")
        name = f"{prefix}.{key}" if prefix else str(key)
        if name in tensors or name in values:
            raise ValueError(f"two entries of the state flatten to the same name {name!r}")
        if isinstance(child, _TENSORS):
            tensors[name] = _tensor_leaf(name, child, memo)
        elif isinstance(child, WalkedPart):
            _merge(name, child, tensors, values)
        elif isinstance(child, Mapping) or (isinstance(child, list) and _has_tensor(child)):
            _walk(name, child, tensors, values, memo)
        elif isinstance(child, tuple) and _has_tensor(child):
            raise TypeError(f"{name}: tuples holding tensors are not supported; use a list")
        elif type(child) in _SCALARS:  # JSON as they are (a long string: no scan of it)
            values[name] = ValueLeaf(name, child, obj, key)
        else:
            try:
                json.dumps(child)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"{name}: value of type {type(child).__name__} is neither a tensor nor "
                    f"JSON-serialisable ({e}); convert it before saving"
                ) from e
            _refuse_merged_keys(name, child)
            values[name] = ValueLeaf(name, child, obj, key)


def _refuse_merged_keys(name: str, value: Any) -> None:
    """ValueError where a dict inside a JSON value has two keys that JSON writes alike (``1``
    and ``"1"``, ``True`` and ``"true"``): one of them would come back, silently. Other keys
    that are not strings come back as strings, as JSON gives them."""
    if isinstance(value, Mapping):
        written: dict[str, Any] = {}
        for k, v in value.items():
            as_json = k if isinstance(k, str) else json.dumps(k)
            if as_json in written:
                raise ValueError(
                    f"{name}: keys {written[as_json]!r} and {k!r} of a dict in this value are one "
                    f"key in JSON ({as_json!r}), so one of them would be lost; rename one"
                )
            written[as_json] = k
            _refuse_merged_keys(name, v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _refuse_merged_keys(name, v)


def _merge(
    name: str, part: WalkedPart, tensors: dict[str, TensorLeaf], values: dict[str, ValueLeaf]
) -> None:
    """Add a walked part's leaves at ``name``, the place it was walked for."""
    if part.prefix != name:
        raise ValueError(f"{name}: the walked part put here was walked for {part.prefix!r}")
    for mine in (part.tensors, part.values):
        if not (tensors.keys().isdisjoint(mine) and values.keys().isdisjoint(mine)):
            same = sorted({*mine} & {*tensors, *values})[0]
            raise ValueError(f"two entries of the state flatten to the same name {same!r}")
    tensors.update(part.tensors)
    values.update(part.values)
