"""Regular layouts: tensors split over the ranks by a rule every rank can evaluate alone; a
writer plans its objects and a reader derives any rank's pieces with the same code
(``RegularLayout.rank_objects``; docs/format.md, "Tensors described by a rule")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ftsdp.storage.format._dtypes import torch_dtype
from ftsdp.storage.format._json import MAX_INT
from ftsdp.storage.format._objects import PlannedObject, PlannedPiece, pack
from ftsdp.storage.format._ranges import Range


@dataclass(frozen=True)
class Rule:
    """How a tensor's elements are split over the ranks: ``"even"``, ``"writer"`` (as in the
    manifest), ``"whole"`` (every rank holds it; planned as one of those) or ``"irregular"``."""

    kind: str
    start: int = 0
    chunk: int = 0
    writer: int = 0

    def held(self, rank: int, numel: int) -> Range:
        """The elements of a tensor of ``numel`` elements that ``rank`` holds under this rule."""
        if self.kind == "even":
            lo = min(max(rank * self.chunk - self.start, 0), numel)
            hi = min(max((rank + 1) * self.chunk - self.start, 0), numel)
            return Range(lo, hi - lo)
        if self.kind == "writer":
            return Range(0, numel if rank == self.writer else 0)
        if self.kind == "whole":
            return Range(0, numel)
        raise ValueError(f"rule {self.kind!r} assigns no elements")

    def ranks_for(self, lo: int, hi: int) -> range:
        """The ranks holding any element of ``[lo, hi)`` (an ``even`` or ``writer`` rule)."""
        if hi <= lo:
            return range(0)
        if self.kind == "writer":
            return range(self.writer, self.writer + 1)
        return range((self.start + lo) // self.chunk, (self.start + hi - 1) // self.chunk + 1)

    def as_json(self) -> list[Any]:
        """The table form: ``[kind, *arguments]``."""
        if self.kind == "even":
            return ["even", self.start, self.chunk]
        if self.kind == "writer":
            return ["writer", self.writer]
        return [self.kind]


WHOLE = Rule("whole")
IRREGULAR = Rule("irregular")


def infer_rule(
    shape: tuple[int, ...], rng: Range, rank: int, world: int, hint: tuple[int, int] | None = None
) -> Rule:
    """The rule of a tensor of ``shape`` of which ``rank`` (of ``world``) holds ``rng``, only
    if it gives this rank exactly ``rng`` (else ``IRREGULAR``). ``hint``: ``FlatShard.layout``;
    without it a whole range is ``whole`` and a ``Shard(0)`` row split ``even``."""
    numel = math.prod(shape)
    if hint is not None:
        start, chunk = hint
        rule = Rule("even", int(start), int(chunk))
        fits = 1 <= chunk <= MAX_INT and 0 <= start <= MAX_INT and start + numel <= world * chunk
        return rule if fits and _same(rule.held(rank, numel), rng) else IRREGULAR
    if rng.offset == 0 and rng.length == numel:
        return WHOLE
    if shape and numel:
        row = numel // shape[0]
        rule = Rule("even", 0, -(-shape[0] // world) * row)
        if _same(rule.held(rank, numel), rng):
            return rule
    return IRREGULAR


def _same(a: Range, b: Range) -> bool:
    return a.length == b.length and (a.offset == b.offset or a.length == 0)


@dataclass(frozen=True)
class RegularLayout:
    """The regular part of a save: ``entries`` ``(name, shape, dtype name, rule)`` in name
    order (rules ``even`` or ``writer``), planned for ``world`` ranks."""

    world: int
    object_bytes: int
    entries: tuple[tuple[str, tuple[int, ...], str, Rule], ...]

    def rank_objects(
        self, rank: int, attempt: str, limit: int | None = None
    ) -> list[PlannedObject]:
        """Rank ``rank``'s regular objects, named for ``attempt`` (``limit``: see ``pack``): a
        piece per tensor it holds part of, in name order."""
        pieces = []
        for name, shape, dtype, rule in self.entries:
            rng = rule.held(rank, math.prod(shape))
            if rng.length:
                pieces.append(PlannedPiece(name, rng.offset, rng.length, torch_dtype(dtype)))
        return pack(rank, pieces, attempt, self.object_bytes, limit)


def resolve(
    table: list[list[Any]], world: int, object_bytes: int, replica_split_bytes: int
) -> RegularLayout:
    """The layout of an agreed table: ``whole`` tensors become a ``writer`` (round robin) or,
    from ``replica_split_bytes`` on, ``even``; ``irregular`` rows are left out."""
    entries = []
    turn = 0
    for name, shape, dtype, rule_json in table:
        rule = rule_from_json(rule_json)
        shape = tuple(shape)
        numel = math.prod(shape)
        if rule.kind == "irregular":
            continue
        if rule.kind == "whole":
            if numel * torch_dtype(dtype).itemsize >= replica_split_bytes and numel >= world:
                rule = Rule("even", 0, -(-numel // world))
            else:
                rule, turn = Rule("writer", writer=turn % world), turn + 1
        entries.append((name, shape, dtype, rule))
    return RegularLayout(world, object_bytes, tuple(entries))


def rule_from_json(doc: Any) -> Rule:
    """The rule of a table row or a manifest entry (ValueError for anything else)."""
    if isinstance(doc, list) and doc:
        kind = doc[0]
        if kind == "even" and len(doc) == 3:
            return Rule("even", doc[1], doc[2])
        if kind == "writer" and len(doc) == 2:
            return Rule("writer", writer=doc[1])
        if kind in ("whole", "irregular") and len(doc) == 1:
            return WHOLE if kind == "whole" else IRREGULAR
    raise ValueError(f"not a layout rule: {doc!r}")
