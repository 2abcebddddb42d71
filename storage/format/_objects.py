"""A step's data objects as planned: which pieces (flat ranges of which tensors) each holds,
in which order, and its safetensors header and byte ranges (docs/format.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ftsdp.storage.format._layout import object_name
from ftsdp.storage.format._safetensors import layout


@dataclass(frozen=True)
class PlannedPiece:
    name: str
    offset: int
    length: int
    dtype: torch.dtype

    @property
    def key(self) -> str:
        return f"{self.name}@{self.offset}"


@dataclass
class PlannedObject:
    """One data object: its writer, pieces, and (derived) header and byte ranges."""

    name: str
    rank: int
    pieces: list[PlannedPiece] = field(default_factory=list)
    head: bytes = b""
    byte_ranges: list[tuple[int, int]] = field(default_factory=list)
    size: int = 0

    @property
    def payload_bytes(self) -> int:
        return self.size - len(self.head)

    @classmethod
    def laid_out(cls, name: str, rank: int, pieces: list[PlannedPiece]) -> PlannedObject:
        """The object ``name`` of ``rank`` holding ``pieces``, with its header and byte ranges."""
        head, byte_ranges, size = layout([(p.key, p.dtype, [p.length]) for p in pieces])
        return cls(name, rank, pieces, head, byte_ranges, size)


def pack(
    rank: int, pieces: list[PlannedPiece], attempt: str, cap: int, limit: int | None = None
) -> list[PlannedObject]:
    """Pack a rank's pieces into objects of at most ``cap`` payload bytes (splitting big ones).
    ``limit``: ValueError as soon as the pieces fill more objects than that (a reader deriving a
    layout from a manifest, whose object count bounds the work)."""
    objects: list[PlannedObject] = []
    current: list[PlannedPiece] = []
    used = 0

    def close() -> None:
        nonlocal current, used
        if current:
            if limit is not None and len(objects) >= limit:
                raise ValueError(f"rank {rank}'s pieces fill more than {limit} objects")
            name = object_name(rank, len(objects), attempt)
            objects.append(PlannedObject.laid_out(name, rank, current))
        current, used = [], 0

    for piece in pieces:
        size = piece.dtype.itemsize
        offset, left = piece.offset, piece.length
        while left:
            room = (cap - used) // size
            if room <= 0 and current:
                close()
                continue
            take = min(left, max(room, 1))  # an object holds at least one element
            current.append(PlannedPiece(piece.name, offset, take, piece.dtype))
            used += take * size
            offset, left = offset + take, left - take
    close()
    return objects
