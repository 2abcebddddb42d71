"""Which byte ranges to read: wanted regions (a flat range or a box of a tensor) turned into runs
of the saved order (storage/format/_grid.py), intersected with saved pieces, then coalesced.

Reads are widened to whole checksum blocks of the piece (so every byte read is verified); with
blocks small against the ranges wanted, the bytes read stay close to the bytes needed.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from ftsdp.storage.format._dtypes import itemsize, torch_dtype
from ftsdp.storage.format._grid import Box, Run, flat_tiles, runs, whole
from ftsdp.storage.format._manifest import Piece, TensorEntry
from ftsdp.storage.format._ranges import Range, coalesce, intersect


@dataclass
class Want:
    """Row-major elements ``range`` of tensor ``name`` (or, with ``box``, that box's elements,
    row-major in the box) go into ``staging`` (1-D, the saved dtype)."""

    name: str
    entry: TensorEntry
    range: Range
    staging: torch.Tensor
    box: Box | None = None

    @property
    def numel(self) -> int:
        return self.range.length if self.box is None else self.box.numel


@dataclass
class Copy:
    """Source bytes ``[src, src + nbytes)`` of an object go to ``dst`` from byte ``dst_byte``.
    With ``row``, they are bytes ``[lead, lead + nbytes)`` of a run of rows: row ``i`` is its
    bytes ``[i * stride, i * stride + row)`` (the rest of a stride is a gap, not copied) and goes
    to ``dst`` from byte ``dst_byte + i * pitch``."""

    src: int  # absolute byte offset in the object
    nbytes: int
    dst: torch.Tensor  # uint8 view of a staging tensor
    dst_byte: int
    want: int = -1  # index of the Want it fills
    row: int = 0
    pitch: int = 0
    lead: int = 0
    stride: int = 0


@dataclass
class Span:
    """One ranged read of ``object``: bytes ``[start, end)``, the blocks to verify, the copies."""

    object: str
    start: int
    end: int
    # (piece byte_start, block index) -> (tensor name, piece, block index)
    blocks: dict[tuple[int, int], tuple[str, Piece, int]] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)


def make_want(name: str, entry: TensorEntry, rng: Range, box: Box | None = None) -> Want:
    n = rng.length if box is None else box.numel
    return Want(name, entry, rng, torch.empty(n, dtype=torch_dtype(entry.dtype)), box)


def _runs(w: Want) -> list[Run]:
    """The runs of the saved order that fill ``w``."""
    entry = w.entry
    if w.box is None and entry.grid is None:  # row-major both: one run
        return [Run(w.range.offset, 0, w.range.length)] if w.range.length else []
    tiles = [(w.box, 0)] if w.box is not None else flat_tiles(*w.range, entry.shape)
    return runs(entry.shape, entry.grid or whole(entry.shape), tiles)


def _spans(run: Run, gap: int) -> list[Run]:
    """``run`` as runs each read as one span of the saved order: one, unless its rows are more
    than ``gap`` elements apart there (then a run per row: the gaps are not read)."""
    if run.rows == 1 or run.src_pitch - run.length <= gap:
        return [run]
    return [
        Run(run.src + i * run.src_pitch, run.dst + i * run.dst_pitch, run.length)
        for i in range(run.rows)
    ]


def plan_reads(wants: list[Want], block: int, gap: int = 0) -> list[Span]:
    """The coalesced ranged reads that fill every ``Want`` (each read within one object)."""
    requests: dict[str, list[tuple[int, int, list, Copy]]] = {}
    for index, w in enumerate(wants):
        size = itemsize(w.staging.dtype)
        dst = w.staging.view(torch.uint8)
        within = max(block // size, 1)  # a gap inside a checksum block is read anyway
        for whole_run in _runs(w):
            for run in _spans(whole_run, within):
                plain = run.rows == 1 or run.src_pitch == run.dst_pitch == run.length
                src, end = run.src, run.src + (run.rows - 1) * run.src_pitch + run.length
                for p in w.entry.pieces_in(src, end):
                    inter = intersect(p.range, Range(src, end - src))
                    if inter is None:
                        continue
                    b0 = (inter.offset - p.offset) * size
                    b1 = b0 + inter.length * size
                    a0, a1 = b0 // block * block, min(-(-b1 // block) * block, p.length * size)
                    blocks = [(w.name, p, k) for k in range(a0 // block, -(-a1 // block))]
                    skip = inter.offset - src
                    if plain:
                        copy = Copy(p.byte_start + b0, b1 - b0, dst, (run.dst + skip) * size, index)
                    else:
                        copy = Copy(
                            p.byte_start + b0, b1 - b0, dst, run.dst * size, index,
                            run.length * size, run.dst_pitch * size, skip * size,
                            run.src_pitch * size,
                        )  # fmt: skip
                    requests.setdefault(p.object, []).append(
                        (p.byte_start + a0, p.byte_start + a1, blocks, copy)
                    )
    spans: list[Span] = []
    for obj, reqs in sorted(requests.items()):
        merged = coalesce([(s, e) for s, e, _, _ in reqs], gap)
        by_start = [Span(obj, s, e) for s, e in merged]
        starts = [s.start for s in by_start]
        for s, _, blocks, copy in reqs:
            span = by_start[bisect_right(starts, s) - 1]
            span.blocks.update(((b[1].byte_start, b[2]), b) for b in blocks)
            span.copies.append(copy)
        spans.extend(by_start)
    return spans
