"""Which byte ranges to read: wanted flat ranges intersected with saved pieces, then coalesced.

Reads are widened to whole checksum blocks of the piece (so every byte read is verified); with
blocks small against the ranges wanted, the bytes read stay close to the bytes needed.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from ftsdp.storage.format._dtypes import itemsize, torch_dtype
from ftsdp.storage.format._manifest import Piece, TensorEntry
from ftsdp.storage.format._ranges import Range, coalesce, intersect


@dataclass
class Want:
    """Elements ``range`` of tensor ``name`` go into ``staging`` (1-D, the saved dtype)."""

    name: str
    entry: TensorEntry
    range: Range
    staging: torch.Tensor


@dataclass
class Copy:
    src: int  # absolute byte offset in the object
    nbytes: int
    dst: torch.Tensor  # uint8 view of a staging tensor
    dst_byte: int
    want: int = -1  # index of the Want it fills


@dataclass
class Span:
    """One ranged read of ``object``: bytes ``[start, end)``, the blocks to verify, the copies."""

    object: str
    start: int
    end: int
    # (piece byte_start, block index) -> (tensor name, piece, block index)
    blocks: dict[tuple[int, int], tuple[str, Piece, int]] = field(default_factory=dict)
    copies: list[Copy] = field(default_factory=list)


def make_want(name: str, entry: TensorEntry, rng: Range) -> Want:
    return Want(name, entry, rng, torch.empty(rng.length, dtype=torch_dtype(entry.dtype)))


def plan_reads(wants: list[Want], block: int, gap: int = 0) -> list[Span]:
    """The coalesced ranged reads that fill every ``Want`` (each read within one object)."""
    requests: dict[str, list[tuple[int, int, list, Copy]]] = {}
    for index, w in enumerate(wants):
        size = itemsize(w.staging.dtype)
        dst = w.staging.view(torch.uint8)
        for p in w.entry.pieces_in(w.range.offset, w.range.end):
            inter = intersect(p.range, w.range)
            if inter is None:
                continue
            b0 = (inter.offset - p.offset) * size
            b1 = b0 + inter.length * size
            a0, a1 = b0 // block * block, min(-(-b1 // block) * block, p.length * size)
            blocks = [(w.name, p, k) for k in range(a0 // block, -(-a1 // block))]
            copy = Copy(
                p.byte_start + b0, b1 - b0, dst, (inter.offset - w.range.offset) * size, index
            )
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
