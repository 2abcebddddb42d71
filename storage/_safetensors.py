"""Write safetensors objects piece by piece, checksumming each block as its bytes go out.

An object is a standard safetensors file (readable by ``safetensors.torch.load``): an 8-byte
little-endian header length, a JSON header padded with spaces to 8 bytes, then the data. Every
tensor in it is 1-D: one saved piece. The header depends only on the list of pieces, so every rank
can compute every object's byte layout from the save plan without seeing the bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import IO

import torch

from ftsdp.storage._dtypes import itemsize, safetensors_code

try:  # the same CRC-32 as zlib's, about 3x faster (ISA-L); optional: ``pip install isal``
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - depends on the environment
    from zlib import crc32

_WRITE_CHUNK = 8 << 20  # bytes handed to the file object at once


def layout(
    entries: Sequence[tuple[str, torch.dtype, int]],
) -> tuple[bytes, list[tuple[int, int]], int]:
    """Header bytes, absolute ``(start, end)`` byte range of each entry, and the object size.

    ``entries`` are ``(key, dtype, numel)`` in the order their bytes follow the header.
    """
    header: dict[str, object] = {"__metadata__": {"format": "ftsdp.storage"}}
    pos = 0
    rel = []
    for key, dtype, numel in entries:
        nbytes = numel * itemsize(dtype)
        header[key] = {
            "dtype": safetensors_code(dtype),
            "shape": [numel],
            "data_offsets": [pos, pos + nbytes],
        }
        rel.append((pos, pos + nbytes))
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    base = len(head)
    return head, [(base + s, base + e) for s, e in rel], base + pos


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a 1-D CPU tensor, without copying when it is contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def write_object(
    f: IO[bytes], head: bytes, payloads: Sequence[torch.Tensor], block_bytes: int
) -> list[list[int]]:
    """Write ``head`` then each payload's bytes; return each payload's per-block crc32 list."""
    f.write(head)
    crcs = []
    for t in payloads:
        mv = tensor_bytes(t)
        blocks = []
        for start in range(0, len(mv), block_bytes):
            block = mv[start : start + block_bytes]
            blocks.append(crc32(block))
            for off in range(0, len(block), _WRITE_CHUNK):
                f.write(block[off : off + _WRITE_CHUNK])
        crcs.append(blocks)
    return crcs
