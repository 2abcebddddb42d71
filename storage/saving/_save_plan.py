"""Decide, from the metadata every rank gathered, which rank writes which bytes into which object
(docs/format.md, "Data objects"): every rank gets the same plan from the same metadata, and a
replicated segment is written once (split among its holders when large, else by the least-loaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._dtypes import torch_dtype
from ftsdp.storage.format._grid import Cuts
from ftsdp.storage.format._layout import object_name
from ftsdp.storage.format._objects import PlannedObject, PlannedPiece, pack
from ftsdp.storage.format._ranges import Range, check_disjoint_cover, check_range, segments


@dataclass
class SavePlan:
    """Which rank writes what. ``objects``: the listed objects this rank knows (every rank's on
    the coordinator); ``regular``: the ``RegularLayout`` of the rule tensors; ``mine``: this
    rank's objects when not all in ``objects`` (its regular ones first)."""

    attempt: str
    shapes: dict[str, tuple[tuple[int, ...], str]]  # name -> (global shape, dtype name)
    objects: list[PlannedObject]
    regular: Any = None
    mine: list[PlannedObject] | None = None
    replaces: str | None = None  # the attempt of an earlier commit of the step it replaces
    grids: dict[str, Cuts] = field(default_factory=dict)  # name -> grid, for tensors on one

    def for_rank(self, rank: int) -> list[PlannedObject]:
        """Rank ``rank``'s listed objects."""
        return [o for o in self.objects if o.rank == rank]

    def own(self, rank: int) -> list[PlannedObject]:
        """Every object this rank (``rank``) writes."""
        return self.for_rank(rank) if self.mine is None else self.mine


def renamed(
    objects: list[PlannedObject], attempt: str, first: dict[int, int] | None = None
) -> list[PlannedObject]:
    """``objects`` (same pieces and layout) named for ``attempt``; a rank's objects are numbered
    from ``first[rank]`` (default 0) in order."""
    out: list[PlannedObject] = []
    index = {r: i - 1 for r, i in (first or {}).items()}
    for o in objects:
        i = index[o.rank] = index.get(o.rank, -1) + 1
        out.append(replace(o, name=object_name(o.rank, i, attempt), pieces=list(o.pieces)))
    return out


def make_plan(metas: list[dict[str, Any]], attempt: str, options: SaveOptions) -> SavePlan:
    """The plan for gathered per-rank metadata; ValueError (same on every rank) if inconsistent.

    ``metas[r]["tensors"]`` lists ``[name, shape, dtype, offset, length]`` for rank r, and the
    grid as a sixth item for a tensor on one (the range is then in its grid order).
    """
    held: dict[str, dict[int, Range]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    grids: dict[str, Cuts | None] = {}
    for rank, meta in enumerate(metas):
        for name, shape, dtype, offset, length, *rest in meta["tensors"]:
            shape = tuple(shape)
            grid = tuple(tuple(c) for c in rest[0]) if rest and rest[0] is not None else None
            if name in shapes and (shapes[name], grids[name]) != ((shape, dtype), grid):
                first = min(held[name])
                raise ValueError(
                    f"tensor {name!r}: rank {rank} has shape={shape} dtype={dtype} grid={grid} "
                    f"but rank {first} has shape={shapes[name][0]} dtype={shapes[name][1]} "
                    f"grid={grids[name]}"
                )
            shapes[name], grids[name] = (shape, dtype), grid
            rng = Range(offset, length)
            check_range(rng, math.prod(shape), f"tensor {name!r} on rank {rank}")
            held.setdefault(name, {})[rank] = rng

    load = [0] * len(metas)
    per_rank: dict[int, list[PlannedPiece]] = {r: [] for r in range(len(metas))}
    for name in sorted(held):
        shape, dtype_s = shapes[name]
        dtype = torch_dtype(dtype_s)
        size = dtype.itemsize
        numel = math.prod(shape)
        segs = segments(held[name].values())
        try:
            check_disjoint_cover(segs, numel, f"tensor {name!r} {shape=}")
        except ValueError as e:
            raise ValueError(
                f"{e} (held by no rank); the ranks' ranges must together cover the whole tensor"
            ) from None
        for seg in segs:
            holders = sorted(
                r for r, rng in held[name].items() if rng.offset <= seg.offset < rng.end
            )
            if len(holders) > 1 and seg.length * size >= options.replica_split_bytes:
                bounds = [
                    seg.offset + seg.length * i // len(holders) for i in range(len(holders) + 1)
                ]
                parts = [(holders[i], bounds[i], bounds[i + 1]) for i in range(len(holders))]
            else:
                writer = min(holders, key=lambda r: (load[r], r))
                parts = [(writer, seg.offset, seg.end)]
            for writer, lo, hi in parts:
                if hi == lo:
                    continue
                load[writer] += (hi - lo) * size
                mine = per_rank[writer]
                if mine and mine[-1].name == name and mine[-1].offset + mine[-1].length == lo:
                    prev = mine.pop()  # contiguous with the previous piece: extend it
                    lo = prev.offset
                mine.append(PlannedPiece(name, lo, hi - lo, dtype))

    objects: list[PlannedObject] = []
    for rank, pieces in per_rank.items():
        objects.extend(pack(rank, pieces, attempt, options.object_bytes))
    return SavePlan(
        attempt, shapes, objects, grids={n: g for n, g in grids.items() if g is not None}
    )
