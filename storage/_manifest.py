"""The versioned manifest (format version 1, see docs/format.md): encode, decode, validate.

Everything a reader trusts comes from here, so ``Manifest.from_json`` validates the whole document
before any byte is read: unknown versions, unsafe object names, ranges that overlap, leave gaps or
disagree with the shape and dtype, and byte ranges past an object's end all raise.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ftsdp.storage._dtypes import itemsize, torch_dtype
from ftsdp.storage._errors import CorruptCheckpointError, NewerFormatError
from ftsdp.storage._ranges import Range, check_disjoint_cover

FORMAT_NAME = "ftsdp.storage"
FORMAT_VERSION = 1
CHECKSUM_ALGORITHM = "crc32"

# An object name is one path component inside the step prefix: no separators, no "..", no scheme.
_OBJECT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Piece:
    """A saved flat range of one tensor: elements ``[offset, offset+length)`` at a byte range."""

    object: str
    key: str
    offset: int
    length: int
    byte_start: int
    byte_end: int
    crc32: tuple[int, ...]  # one per checksum block of the piece's bytes

    @property
    def range(self) -> Range:
        return Range(self.offset, self.length)


@dataclass(frozen=True)
class TensorEntry:
    """Global shape, dtype and the pieces (sorted by offset, tiling the tensor) of one tensor."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Manifest:
    """The committed description of one step."""

    step: int
    world_size: int
    attempt: str
    checksum_block_bytes: int
    objects: dict[str, int]  # object name -> size in bytes
    tensors: dict[str, TensorEntry]
    values: dict[str, Any] = field(default_factory=dict)
    rank_values: list[dict[str, Any]] = field(default_factory=list)
    version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """The manifest document as UTF-8 JSON bytes."""
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": self.checksum_block_bytes},
            "objects": {name: {"size": size} for name, size in sorted(self.objects.items())},
            "tensors": {
                name: {
                    "shape": list(t.shape),
                    "dtype": t.dtype,
                    "pieces": [
                        {
                            "object": p.object,
                            "key": p.key,
                            "offset": p.offset,
                            "length": p.length,
                            "byte_range": [p.byte_start, p.byte_end],
                            "crc32": list(p.crc32),
                        }
                        for p in t.pieces
                    ],
                }
                for name, t in sorted(self.tensors.items())
            },
            "values": self.values,
            "rank_values": self.rank_values,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> Manifest:
        """Decode and validate a manifest; ``where`` (a URL) goes into every error message."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from e
        return _decode(doc, where)


def _is_int(x: Any, minimum: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= minimum


def _decode(doc: Any, where: str) -> Manifest:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise CorruptCheckpointError(f"{where}: {msg}")

    need(isinstance(doc, dict), "manifest is not a JSON object")
    need(doc.get("format") == FORMAT_NAME, f"format is {doc.get('format')!r}, not {FORMAT_NAME!r}")
    version = doc.get("version")
    need(_is_int(version, 1), f"version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{where}: manifest format version {version} is newer than this code reads "
            f"({FORMAT_VERSION}); upgrade the storage package"
        )
    for key in ("step", "world_size"):
        need(_is_int(doc.get(key), 0 if key == "step" else 1), f"{key}={doc.get(key)!r} invalid")
    checksum = doc.get("checksum")
    need(
        isinstance(checksum, dict) and checksum.get("algorithm") == CHECKSUM_ALGORITHM,
        f"checksum algorithm must be {CHECKSUM_ALGORITHM!r}, got {checksum!r}",
    )
    block = checksum.get("block_bytes")
    need(_is_int(block, 1), f"checksum block_bytes={block!r} invalid")

    objects: dict[str, int] = {}
    need(isinstance(doc.get("objects"), dict), "objects is not a JSON object")
    for name, meta in doc["objects"].items():
        need(
            bool(_OBJECT_NAME.match(name)) and ".." not in name,
            f"object name {name!r} escapes the step prefix (only a plain file name is allowed)",
        )
        need(isinstance(meta, dict) and _is_int(meta.get("size")), f"object {name}: bad size")
        objects[name] = meta["size"]

    tensors: dict[str, TensorEntry] = {}
    need(isinstance(doc.get("tensors"), dict), "tensors is not a JSON object")
    for name, t in doc["tensors"].items():
        need(isinstance(t, dict), f"tensor {name}: not a JSON object")
        shape = t.get("shape")
        need(
            isinstance(shape, list) and all(_is_int(d) for d in shape),
            f"tensor {name}: shape={shape!r} must be a list of non-negative integers",
        )
        try:
            size = itemsize(torch_dtype(t.get("dtype")))
        except (KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{where}: tensor {name}: {e}") from None
        need(isinstance(t.get("pieces"), list), f"tensor {name}: pieces is not a list")
        pieces = []
        for p in t["pieces"]:
            pieces.append(_decode_piece(p, name, size, block, objects, need))
        pieces.sort(key=lambda p: p.offset)
        numel = math.prod(shape)
        try:
            check_disjoint_cover([p.range for p in pieces], numel, f"tensor {name} {shape=}")
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
        tensors[name] = TensorEntry(tuple(shape), t["dtype"], tuple(pieces))

    values = doc.get("values", {})
    rank_values = doc.get("rank_values", [])
    need(isinstance(values, dict), "values is not a JSON object")
    need(
        isinstance(rank_values, list) and all(isinstance(v, dict) for v in rank_values),
        "rank_values is not a list of JSON objects",
    )
    return Manifest(
        step=doc["step"],
        world_size=doc["world_size"],
        attempt=str(doc.get("attempt", "")),
        checksum_block_bytes=block,
        objects=objects,
        tensors=tensors,
        values=values,
        rank_values=rank_values,
        version=version,
    )


def _decode_piece(p: Any, name: str, size: int, block: int, objects: dict, need: Any) -> Piece:
    need(isinstance(p, dict), f"tensor {name}: piece is not a JSON object")
    obj, br, crc = p.get("object"), p.get("byte_range"), p.get("crc32")
    what = f"tensor {name} piece at offset {p.get('offset')!r}"
    need(obj in objects, f"{what}: object {obj!r} is not listed in objects")
    need(_is_int(p.get("offset")), f"{what}: offset must be a non-negative integer")
    need(_is_int(p.get("length"), 1), f"{what}: length={p.get('length')!r} must be positive")
    need(
        isinstance(br, list) and len(br) == 2 and all(_is_int(b) for b in br),
        f"{what}: byte_range={br!r} must be [start, end] with non-negative integers",
    )
    nbytes = br[1] - br[0]
    need(
        nbytes == p["length"] * size,
        f"{what}: byte_range {br} holds {nbytes} bytes but length={p['length']} needs "
        f"{p['length'] * size}",
    )
    need(
        br[1] <= objects[obj],
        f"{what}: byte_range {br} is past the end of {obj} ({objects[obj]} bytes)",
    )
    need(
        isinstance(crc, list) and len(crc) == -(-nbytes // block) and all(_is_int(c) for c in crc),
        f"{what}: crc32 must list one checksum per {block}-byte block",
    )
    need(isinstance(p.get("key"), str), f"{what}: key must be a string")
    return Piece(obj, p["key"], p["offset"], p["length"], br[0], br[1], tuple(crc))
