"""Safetensors objects (docs/format.md, "Data objects"): written piece by piece, checksumming
each block as its bytes go out, and their headers read and checked."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from typing import IO, Any, NoReturn

import torch

from ftsdp.storage._errors import CheckpointNotFoundError, CorruptCheckpointError
from ftsdp.storage.format._checksum import WRITTEN, checksum_function
from ftsdp.storage.format._dtypes import safetensors_code
from ftsdp.storage.format._json import MAX_INT, decode_json, show
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._streaming import tensor_bytes

_WRITE_SPAN = 2 << 20  # the data goes to the file in spans ending on multiples of this


def layout(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: dict[str, str] | None = None,
) -> tuple[bytes, list[tuple[int, int]], int]:
    """Header bytes (``metadata`` as ``__metadata__``), absolute byte range of each ``(key,
    dtype, shape)`` entry, file size."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "ftsdp.storage"}}
    pos = 0
    rel = []
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": safetensors_code(dtype),
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        rel.append((pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    base = len(head)
    return head, [(base + s, base + e) for s, e in rel], base + pos


def write_object(
    f: IO[bytes],
    head: bytes,
    pieces: int,
    chunks: Iterable[tuple[int, torch.Tensor | memoryview]],
    block_bytes: int,
) -> list[list[int]]:
    """Write ``head``, then ``chunks``: ``(piece index, 1-D tensor or bytes)`` in piece order (a
    piece whole or in consecutive chunks). Returns each piece's per-block checksums."""
    f.write(head)
    crcs: list[list[int]] = [[] for _ in range(pieces)]
    checksum = checksum_function(WRITTEN)
    # Spans end on multiples of _WRITE_SPAN in the object (docs/format.md, "Integrity"); each is
    # checksummed right before it is written.
    pos = len(head)
    current, crc, n = -1, 0, 0  # the piece being checksummed, its running checksum, its bytes
    for i, t in chunks:
        if i != current:
            if n:
                crcs[current].append(crc)
            current, crc, n = i, 0, 0
        mv = t if isinstance(t, memoryview) else tensor_bytes(t)
        size = len(mv)
        if size <= block_bytes - n and pos % _WRITE_SPAN + size <= _WRITE_SPAN:
            # most chunks are small tensors within one block and one span: no loop
            crc, n = checksum(mv, crc), n + size
            f.write(mv)
            pos += size
            if n == block_bytes:
                crcs[i].append(crc)
                crc, n = 0, 0
            continue
        off = 0
        while off < size:
            end = min(size, off + _WRITE_SPAN - pos % _WRITE_SPAN)
            span = mv[off:end]
            at = 0  # checksum the span block by block
            while at < len(span):
                take = min(block_bytes - n, len(span) - at)
                crc, n = checksum(span[at : at + take], crc), n + take
                at += take
                if n == block_bytes:
                    crcs[i].append(crc)
                    crc, n = 0, 0
            f.write(span)
            pos += end - off
            off = end
    if n:
        crcs[current].append(crc)
    return crcs


def read_header(store: Store, rel: str) -> tuple[dict[str, Any], int]:
    """The JSON header of the safetensors file ``rel`` and the byte offset where its data starts;
    CorruptCheckpointError unless every tensor's data lies inside the file."""
    where = f"safetensors file {store.where(rel)}"

    def bad(msg: str) -> NoReturn:
        raise CorruptCheckpointError(f"{where}{msg}")

    try:
        size = store.size(rel)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist") from None
    if size < 8:
        bad(" is shorter than 8 bytes: not a safetensors file")
    (n,) = struct.unpack("<Q", store.read_range(rel, 0, 8))
    if n > min(size - 8, 100 << 20):
        bad(f": header length {n} is past the end of the file ({size} bytes)")
    header = decode_json(store.read_range(rel, 8, 8 + n), where=where, what="header")
    if not isinstance(header, dict):
        bad(": header is not a JSON object")
    meta = header.get("__metadata__")  # null: none, as the safetensors library reads it
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):  # json.loads gives str keys
        bad(f": __metadata__ must map strings to strings, got {show(meta)}")
    data_len = size - 8 - n
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict):
            bad(f": tensor {key!r} is described by {show(entry)}, not a JSON object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (
            isinstance(shape, list) and all(type(d) is int and 0 <= d <= MAX_INT for d in shape)
        ):
            bad(f": tensor {key!r} has shape {show(shape)}, not a list of non-negative integers")
        if not isinstance(dtype, str):
            bad(f": tensor {key!r} has dtype {show(dtype)}, not a string")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            bad(
                f": tensor {key!r} has data_offsets {show(offsets)} outside the {data_len} data "
                "bytes (truncated or corrupt file)"
            )
    return header, 8 + n
