"""The versioned manifest (docs/format.md, "manifest.json"): encode, decode, validate.

``Manifest.from_json`` fails only with a ``CheckpointError`` whatever its bytes, and bounds the
work a hostile document can cause (docs/format.md, "Rules a reader enforces", "Threat model")."""

from __future__ import annotations

import base64
import binascii
import errno
import itertools
import json
import math
import re
import struct
import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NoReturn, TypeGuard

from ftsdp.storage._errors import CheckpointNotFoundError, CorruptCheckpointError, NewerFormatError
from ftsdp.storage._options import MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, LoadOptions
from ftsdp.storage.format._checksum import ALGORITHM_OF_VERSION, WRITTEN, checksum_function
from ftsdp.storage.format._dtypes import torch_dtype
from ftsdp.storage.format._grid import Cuts, check_cuts
from ftsdp.storage.format._json import MAX_INT, decode_json, show, too_deep
from ftsdp.storage.format._layout import object_name
from ftsdp.storage.format._ranges import Range, check_disjoint_cover
from ftsdp.storage.format._regular import RegularLayout, Rule, rule_from_json
from ftsdp.storage.io._fs import Store

FORMAT_NAME = "ftsdp.storage"
# Versions 1 to 5 load (docs/format.md, "Versions"); a manifest is written with the lowest
# version that holds it: 5 with a grid, 4 with rule tensors, else 3.
FORMAT_VERSION = 5
RULES_VERSION = 4  # the first version with layout rules
PLAIN_VERSION = 3  # the version of a manifest that lists every piece
SELF_CHECKSUM = "manifest_checksum"  # {"algorithm": the version's algorithm, "value": uint32}
Fail = Callable[[str], NoReturn]  # a decoder's error: raises, naming where

# An object name is one path component inside the step prefix: no separators, no "..", no scheme,
# no control characters (fullmatch: "$" would also accept a trailing newline).
_OBJECT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def canonical_json(doc: dict[str, Any]) -> bytes:
    """The bytes the manifest checksum covers (docs/format.md, "manifest.json")."""
    return _canonical_value({k: v for k, v in doc.items() if k != SELF_CHECKSUM}).encode()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """Set ``doc``'s manifest checksum (in place) to match its content; returns ``doc``."""
    doc[SELF_CHECKSUM] = _self_checksum(doc, canonical_json(doc))
    return doc


def _self_checksum(doc: dict[str, Any], canonical: bytes) -> dict[str, Any]:
    """The checksum field of ``doc`` whose canonical encoding is ``canonical``."""
    algorithm = ALGORITHM_OF_VERSION.get(doc.get("version", 0), WRITTEN)
    return {"algorithm": algorithm, "value": checksum_function(algorithm)(canonical, 0)}


def sealed_json(doc: dict[str, Any]) -> bytes:
    """``doc`` as written, sealed: top-level keys in ``doc``'s order (``format`` first, where
    format detection looks), ``manifest_checksum`` last. Each top-level value is encoded once,
    canonically, except the user's ``values`` and ``rank_values``, also kept in their own order."""
    compact = (",", ":")
    canonical = {
        k: f"{json.dumps(k)}:{_canonical_value(v)}" for k, v in doc.items() if k != SELF_CHECKSUM
    }
    body = ("{" + ",".join(canonical[k] for k in sorted(canonical)) + "}").encode()
    check = _self_checksum(doc, body)
    written = {
        k: f"{json.dumps(k)}:{json.dumps(doc[k], separators=compact)}" if k in _USER_ORDER else part
        for k, part in canonical.items()
    }
    written[SELF_CHECKSUM] = f"{json.dumps(SELF_CHECKSUM)}:{json.dumps(check, separators=compact)}"
    return ("{" + ",".join(written.values()) + "}").encode()


def _canonical_value(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


_USER_ORDER = frozenset({"values", "rank_values"})  # written in the order the user gave


def read_manifest_file(
    store: Store, rel: str, options: LoadOptions | None = None, size: int | None = None
) -> Manifest:
    """Read and decode the manifest at ``rel`` of ``store`` within ``options``' limits (the size,
    asked unless a listing gave it, is checked before any byte is read)."""
    options = options or LoadOptions()
    max_bytes, max_depth = options.max_manifest_bytes, options.max_json_depth
    where = store.where(rel)
    try:
        size = store.size(rel) if size is None else size
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist (removed meanwhile?)") from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise CorruptCheckpointError(f"{where}: a symbolic link loop, not a manifest") from None
    if size > max_bytes:
        raise CorruptCheckpointError(
            f"{where}: manifest of {size} bytes is larger than max_manifest_bytes={max_bytes} "
            "(LoadOptions); refusing to read it"
        )
    try:
        data = store.read_range(rel, 0, size) if size else b""
    except (IsADirectoryError, NotADirectoryError):
        raise CorruptCheckpointError(f"{where}: the manifest is not a file") from None
    return Manifest.from_json(data, where=where, max_bytes=max_bytes, max_depth=max_depth)


@dataclass(frozen=True)
class Piece:
    """A saved flat range of one tensor: elements ``[offset, offset+length)`` at a byte range."""

    object: str
    key: str
    offset: int
    length: int
    byte_start: int
    byte_end: int
    checksums: tuple[int, ...]  # one per checksum block of the piece's bytes

    @property
    def range(self) -> Range:
        return Range(self.offset, self.length)


@dataclass(eq=False)
class RegularIndex:
    """The regular objects of a manifest (version 4): per rank, its object count and block
    checksums; a rank's pieces are derived on first use and checked (docs/format.md)."""

    layout: RegularLayout
    counts: tuple[int, ...]
    checksums: tuple[str, ...]
    _: KW_ONLY
    attempt: str
    step: int
    block: int
    objects: dict[str, int]
    _ranks: dict[int, dict[str, list[Piece]]] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def names(self, rank: int) -> list[str]:
        """The names of rank ``rank``'s regular objects."""
        return [object_name(rank, i, self.attempt) for i in range(self.counts[rank])]

    def rank(self, rank: int) -> dict[str, list[Piece]]:
        """``tensor name -> pieces`` that rank ``rank`` wrote; CorruptCheckpointError when the
        derived layout disagrees with the manifest."""
        with self._lock:
            hit = self._ranks.get(rank)
        if hit is None:
            hit = self._derive(rank)
            with self._lock:
                self._ranks[rank] = hit
        return hit

    def _derive(self, rank: int) -> dict[str, list[Piece]]:
        def corrupt(msg: str) -> NoReturn:
            raise CorruptCheckpointError(f"step {self.step}: rank {rank}'s regular objects: {msg}")

        try:  # packing stops past the count: a huge tensor in tiny objects costs nothing
            objects = self.layout.rank_objects(rank, self.attempt, self.counts[rank])
        except ValueError:
            corrupt(f"the layout gives more objects than the manifest's {self.counts[rank]}")
        if len(objects) != self.counts[rank]:
            corrupt(f"the layout gives {len(objects)} objects, the manifest {self.counts[rank]}")
        try:
            raw = base64.b64decode(self.checksums[rank], validate=True)
        except (binascii.Error, ValueError):
            corrupt("the checksums are not base64")
        if len(raw) % 4:
            corrupt(f"{len(raw)} bytes of checksums is not a whole number of 32-bit values")
        crcs = struct.unpack(f"<{len(raw) // 4}I", raw)
        out: dict[str, list[Piece]] = {}
        pos = 0
        for obj in objects:
            if self.objects.get(obj.name) != obj.size:
                corrupt(
                    f"{obj.name} is listed with {self.objects.get(obj.name)} bytes, the layout "
                    f"gives {obj.size}"
                )
            for p, (b0, b1) in zip(obj.pieces, obj.byte_ranges, strict=True):
                n = -(-(b1 - b0) // self.block)
                piece = Piece(obj.name, p.key, p.offset, p.length, b0, b1, crcs[pos : pos + n])
                out.setdefault(p.name, []).append(piece)
                pos += n
        if pos != len(crcs):
            corrupt(f"the layout has {pos} checksum blocks, the manifest lists {len(crcs)}")
        return out


@dataclass(frozen=True)
class TensorEntry:
    """Global shape, dtype and pieces (sorted by offset, tiling the tensor) of one tensor: listed
    (``explicit``) or, under a layout ``rule`` (version 4), derived from ``regular`` when read.
    Offsets are in the grid order of ``grid`` (version 5), else row-major."""

    shape: tuple[int, ...]
    dtype: str
    explicit: tuple[Piece, ...] = ()
    rule: Rule | None = None
    name: str = ""
    regular: RegularIndex | None = field(default=None, compare=False, repr=False)
    grid: Cuts | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """Every piece, sorted by offset (derived for every rank holding some, for a rule)."""
        if self.rule is None:
            return self.explicit
        return tuple(self.pieces_in(0, self.numel))

    def pieces_in(self, lo: int, hi: int) -> list[Piece]:
        """The pieces holding any element of ``[lo, hi)``, sorted by offset (never a scan)."""
        if self.rule is None:
            pieces = self.explicit
            offsets = self.__dict__.get("_offsets")
            if offsets is None:
                offsets = [p.offset for p in pieces]
                object.__setattr__(self, "_offsets", offsets)
            out = []
            for p in pieces[max(bisect_right(offsets, lo) - 1, 0) :]:
                if p.offset >= hi:
                    break
                if p.offset + p.length > lo:
                    out.append(p)
            return out
        assert self.regular is not None
        return [
            p
            for r in self.rule.ranks_for(lo, hi)
            for p in self.regular.rank(r).get(self.name, ())
            if p.offset < hi and p.offset + p.length > lo
        ]


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
    version: int = PLAIN_VERSION
    regular: RegularIndex | None = field(default=None, compare=False, repr=False)

    @property
    def checksum_algorithm(self) -> str:
        """The algorithm of every checksum of this manifest (storage/format/_checksum.py)."""
        return ALGORITHM_OF_VERSION[self.version]

    def to_json(self) -> bytes:
        """The manifest document as UTF-8 JSON bytes."""
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "checksum": {
                "algorithm": self.checksum_algorithm,
                "block_bytes": self.checksum_block_bytes,
            },
            "objects": {name: {"size": size} for name, size in sorted(self.objects.items())},
            "tensors": {name: self._tensor_json(t) for name, t in sorted(self.tensors.items())},
            "values": self.values,
            "rank_values": self.rank_values,
        }
        if self.regular is not None:
            doc["regular"] = {
                "object_bytes": self.regular.layout.object_bytes,
                "ranks": [
                    list(r) for r in zip(self.regular.counts, self.regular.checksums, strict=True)
                ],
            }
        user = {"values": self.values, "rank_values": self.rank_values}  # at the same depth
        if too_deep(user, MAX_JSON_DEPTH):  # readers would refuse it: fail the save instead
            raise ValueError(
                f"the non-tensor values of step {self.step} nest deeper than a manifest may "
                f"({MAX_JSON_DEPTH} levels of JSON arrays and objects); flatten them"
            )
        return sealed_json(doc)

    def _tensor_json(self, t: TensorEntry) -> dict[str, Any]:
        doc: dict[str, Any] = {"shape": list(t.shape), "dtype": t.dtype}
        if t.grid is not None:
            doc["grid"] = [list(c) for c in t.grid]
        if t.rule is not None:
            doc[t.rule.kind] = t.rule.as_json()[1:]
            return doc
        doc["pieces"] = [
            {
                "object": p.object,
                "key": p.key,
                "offset": p.offset,
                "length": p.length,
                "byte_range": [p.byte_start, p.byte_end],
                self.checksum_algorithm: list(p.checksums),
            }
            for p in t.explicit
        ]
        return doc

    @classmethod
    def from_json(
        cls,
        data: bytes,
        *,
        where: str,
        max_bytes: int = MAX_MANIFEST_BYTES,
        max_depth: int = MAX_JSON_DEPTH,
    ) -> Manifest:
        """Decode and validate a manifest; ``where`` (a URL) goes into every error message.
        CorruptCheckpointError (or NewerFormatError) for anything else."""
        doc = decode_json(
            data, where=where, what="manifest", max_bytes=max_bytes, max_depth=max_depth
        )
        return _decode(doc, where)


def _is_int(x: Any, minimum: int = 0) -> TypeGuard[int]:
    return type(x) is int and minimum <= x <= MAX_INT


def _numel(shape: list[int]) -> int:
    """The product of ``shape``, or ``MAX_INT + 1`` as soon as it passes ``MAX_INT``."""
    n = 1
    for d in shape:
        n *= d
        if n > MAX_INT:
            return MAX_INT + 1 if 0 not in shape else 0
    return n


def _decode(doc: Any, where: str) -> Manifest:
    def fail(msg: str) -> NoReturn:
        raise CorruptCheckpointError(f"{where}: {msg}")

    def need(cond: bool, msg: str) -> None:
        if not cond:
            fail(msg)

    # A JSON object of this format, of a version this code reads, first: a newer version may
    # checksum differently.
    need(isinstance(doc, dict), "manifest is not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        fail(f"format is {show(doc.get('format'))}, not {FORMAT_NAME!r}")
    version = doc.get("version")
    need(_is_int(version, 1), f"version {show(version)} is not a positive integer")
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{where}: manifest format version {version} is newer than this code reads "
            f"({FORMAT_VERSION}); upgrade the storage package"
        )
    algorithm = ALGORITHM_OF_VERSION[version]
    field_ = doc.get(SELF_CHECKSUM)
    if SELF_CHECKSUM in doc or version > 1:  # version 1 was written before the field existed
        if SELF_CHECKSUM not in doc:
            fail(f"a version {version} manifest must carry {SELF_CHECKSUM}: it is corrupt")
        if not (
            isinstance(field_, dict)
            and field_.get("algorithm") == algorithm
            and _is_int(field_.get("value"))
        ):
            fail(
                f"{SELF_CHECKSUM} must be {{'algorithm': {algorithm!r}, 'value': unsigned int}}, "
                f"got {show(field_)}"
            )
        actual = checksum_function(algorithm)(canonical_json(doc), 0)
        if actual != field_["value"]:
            fail(
                f"manifest checksum mismatch (stored {show(field_['value'])}, content {actual}): "
                "the manifest is corrupt or was edited; load another step"
            )
    need(_is_int(doc.get("step")), f"step={show(doc.get('step'))} invalid")
    need(_is_int(doc.get("world_size"), 1), f"world_size={show(doc.get('world_size'))} invalid")
    attempt = doc.get("attempt", "")
    need(isinstance(attempt, str), f"attempt={show(attempt)} is not a string")
    checksum = doc.get("checksum")
    need(
        isinstance(checksum, dict) and checksum.get("algorithm") == algorithm,
        f"checksum algorithm must be {algorithm!r} (format version {version}), got "
        f"{show(checksum)}",
    )
    block = checksum.get("block_bytes")
    need(_is_int(block, 1), f"checksum block_bytes={show(block)} invalid")

    objects: dict[str, int] = {}
    need(isinstance(doc.get("objects"), dict), "objects is not a JSON object")
    for name, meta in doc["objects"].items():
        if not (_OBJECT_NAME.fullmatch(name) and ".." not in name):
            fail(
                f"object name {show(name)} escapes the step prefix (only a plain file name is "
                "allowed)"
            )
        need(isinstance(meta, dict) and _is_int(meta.get("size")), f"object {name}: bad size")
        objects[name] = meta["size"]

    tensors: dict[str, TensorEntry] = {}
    rules: dict[str, tuple[tuple[int, ...], str, Rule, Cuts | None]] = {}
    need(isinstance(doc.get("tensors"), dict), "tensors is not a JSON object")
    for name, t in doc["tensors"].items():
        what = f"tensor {show(name)}"
        need(isinstance(t, dict), f"{what}: not a JSON object")
        shape = t.get("shape")
        if not (isinstance(shape, list) and all(_is_int(d) for d in shape)):
            fail(f"{what}: shape={show(shape)} must be a list of non-negative integers")
        numel = _numel(shape)
        if numel > MAX_INT:
            fail(f"{what}: shape={show(shape)} has more than 2**63-1 elements")
        dtype = t.get("dtype")
        try:
            size = torch_dtype(dtype).itemsize
        except (KeyError, TypeError):
            raise CorruptCheckpointError(
                f"{where}: {what}: unknown dtype {show(dtype)} in manifest"
            ) from None
        grid = _decode_grid(t, version, shape, doc["world_size"], what, fail)
        rule = _decode_rule(t, version, doc["world_size"], numel, what, fail)
        if rule is not None:
            rules[name] = (tuple(shape), dtype, rule, grid)
            continue
        need(isinstance(t.get("pieces"), list), f"{what}: pieces is not a list")
        pieces = [
            _decode_piece(p, what, size, block, algorithm, objects, fail) for p in t["pieces"]
        ]
        pieces.sort(key=lambda p: p.offset)
        try:
            check_disjoint_cover([p.range for p in pieces], numel, what)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: {e} (shape {show(shape)})") from None
        for p in pieces:  # the key names the piece's place: verify binds it to the bytes
            if p.key != f"{name}@{p.offset}":
                fail(f"{what}: the piece at offset {p.offset} is keyed {show(p.key)}")
        tensors[name] = TensorEntry(tuple(shape), dtype, tuple(pieces), grid=grid)

    _check_disjoint_bytes(tensors, fail)
    regular = _decode_regular(
        doc, {n: r[:3] for n, r in rules.items()}, attempt, block, objects, tensors, fail
    )
    for name, (shape, dtype, rule, grid) in rules.items():
        tensors[name] = TensorEntry(shape, dtype, (), rule, name, regular, grid)
    values = doc.get("values", {})
    rank_values = doc.get("rank_values", [])
    need(isinstance(values, dict), "values is not a JSON object")
    if not (isinstance(rank_values, list) and all(isinstance(v, dict) for v in rank_values)):
        fail("rank_values is not a list of JSON objects")
    return Manifest(
        step=doc["step"],
        world_size=doc["world_size"],
        attempt=attempt,
        checksum_block_bytes=block,
        objects=objects,
        tensors=tensors,
        values=values,
        rank_values=rank_values,
        version=version,
        regular=regular,
    )


def _decode_grid(
    t: dict[str, Any], version: int, shape: list[int], world: int, what: str, fail: Fail
) -> Cuts | None:
    """The validated grid of a tensor entry (version 5); None for a row-major one. A grid has
    a cell per distinct shard, so at most ``world`` cells (which bounds a reader's work)."""
    if "grid" not in t:
        return None
    if version < 5:
        fail(f"{what}: a version {version} manifest entry cannot hold a grid")
    problem = check_cuts(t["grid"], shape, world)
    if problem is not None:
        fail(f"{what}: {problem} (shape {show(shape)})")
    return tuple(tuple(c) for c in t["grid"])


def manifest_version(tensors: dict[str, TensorEntry], regular: RegularIndex | None) -> int:
    """The lowest version that holds these tensors (docs/format.md, "Versions")."""
    if any(t.grid is not None for t in tensors.values()):
        return FORMAT_VERSION
    return RULES_VERSION if regular is not None else PLAIN_VERSION


def _decode_rule(
    t: dict[str, Any], version: int, world: int, numel: int, what: str, fail: Fail
) -> Rule | None:
    """The validated layout rule of a tensor entry; None for an entry that lists its pieces."""
    kinds = [k for k in ("even", "writer") if k in t]
    if not kinds:
        return None
    if version < 4 or len(kinds) > 1 or "pieces" in t:
        fail(f"{what}: a version {version} manifest entry cannot hold {[*kinds, 'pieces']}")
    args = t[kinds[0]]
    if not (isinstance(args, list) and all(_is_int(a) for a in args)):
        fail(f"{what}: {kinds[0]}={show(args)} must be a list of non-negative integers")
    try:
        rule = rule_from_json([kinds[0], *args])
    except ValueError:
        fail(f"{what}: {kinds[0]}={show(args)} has the wrong number of arguments")
    if rule.kind == "writer" and rule.writer >= world:
        fail(f"{what}: writer rank {rule.writer} is not below world_size={world}")
    if rule.kind == "even" and (rule.chunk < 1 or rule.start + numel > world * rule.chunk):
        fail(
            f"{what}: even={args} does not cover its {numel} elements with {world} chunks "
            "(every element must fall in the chunk of some rank)"
        )
    return rule


def _decode_regular(
    doc: dict[str, Any],
    rules: dict[str, tuple[tuple[int, ...], str, Rule]],
    attempt: str,
    block: int,
    objects: dict[str, int],
    tensors: dict[str, TensorEntry],
    fail: Fail,
) -> RegularIndex | None:
    """The validated ``regular`` section (present exactly when some tensor has a rule)."""
    section = doc.get("regular")
    if not rules:
        if section is not None:
            fail("regular is present but no tensor has a layout rule")
        return None
    world = doc["world_size"]
    if not (isinstance(section, dict) and _is_int(section.get("object_bytes"), 1)):
        fail(f"regular={show(section)} must be an object with object_bytes >= 1")
    ranks = section.get("ranks")
    if not (
        isinstance(ranks, list)
        and len(ranks) == world
        and all(
            isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and isinstance(r[1], str)
            for r in ranks
        )
    ):
        fail(f"regular.ranks must list [object count, base64 checksums] for each of {world} ranks")
    if any(r[0] > len(objects) for r in ranks):
        fail("regular.ranks counts more objects for a rank than objects lists")
    # Bounds on a reader's work: every piece has a block, so the pieces cannot outnumber the
    # checksums, and ranks x rule tensors (each derivation scans the rules) is bounded by them.
    blocks = sum(len(r[1]) // 4 * 3 // 4 for r in ranks)
    pieces = sum(len(rule.ranks_for(0, math.prod(shape))) for shape, _, rule in rules.values())
    if pieces > blocks:
        fail(f"the rules give {pieces} pieces but regular.ranks lists only {blocks} checksums")
    if world * len(rules) > 64 * blocks + 10**6:
        fail(
            f"{world} ranks x {len(rules)} rule tensors is out of proportion to {blocks} checksums"
        )
    layout = RegularLayout(
        world, section["object_bytes"], tuple((n, *rules[n]) for n in sorted(rules))
    )
    counts, sums = (tuple(column) for column in zip(*ranks, strict=True))
    index = RegularIndex(
        layout, counts, sums, attempt=attempt, step=doc["step"], block=block, objects=objects
    )
    owned = set()
    for rank in range(world):
        for name in index.names(rank):
            if name not in objects:
                fail(f"regular object {name} of rank {rank} is not listed in objects")
            owned.add(name)
    for name, t in tensors.items():
        for p in t.explicit:
            if p.object in owned:
                fail(f"tensor {show(name)}: a listed piece is in regular object {p.object}")
    return index


def _check_disjoint_bytes(tensors: dict[str, TensorEntry], fail: Fail) -> None:
    """No two pieces share a byte of an object (each block is verified against one checksum)."""
    by_object: dict[str, list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        for p in t.pieces:
            by_object.setdefault(p.object, []).append((p.byte_start, p.byte_end, name))
    for obj, spans in by_object.items():
        spans.sort()
        for a, b in itertools.pairwise(spans):
            if b[0] < a[1]:
                fail(
                    f"pieces of tensors {show(a[2])} and {show(b[2])} overlap in object {obj} "
                    f"(bytes [{a[0]}, {a[1]}) and [{b[0]}, {b[1]}))"
                )


def _decode_piece(
    p: Any, what: str, size: int, block: int, algorithm: str, objects: dict, fail: Fail
) -> Piece:
    """One piece, validated (messages are built only on failure: this runs once per piece)."""
    if not isinstance(p, dict):
        fail(f"{what}: piece is not a JSON object")
    obj, br, crc, length = p.get("object"), p.get("byte_range"), p.get(algorithm), p.get("length")

    def at() -> str:
        return f"{what} piece at offset {show(p.get('offset'))}"

    if not (isinstance(obj, str) and obj in objects):
        fail(f"{at()}: object {show(obj)} is not listed in objects")
    if not _is_int(p.get("offset")):
        fail(f"{at()}: offset must be a non-negative integer")
    if not _is_int(length, 1):
        fail(f"{at()}: length={show(length)} must be positive")
    if not (isinstance(br, list) and len(br) == 2 and _is_int(br[0]) and _is_int(br[1])):
        fail(f"{at()}: byte_range={show(br)} must be [start, end] with non-negative integers")
    nbytes = br[1] - br[0]
    if nbytes != length * size:
        fail(
            f"{at()}: byte_range {br} holds {nbytes} bytes but length={length} needs "
            f"{length * size}"
        )
    if br[1] > objects[obj]:
        fail(f"{at()}: byte_range {br} is past the end of {obj} ({objects[obj]} bytes)")
    if not (
        isinstance(crc, list)
        and len(crc) == -(-nbytes // block)
        and all(type(c) is int and 0 <= c <= 0xFFFFFFFF for c in crc)
    ):
        fail(f"{at()}: {algorithm} must list one checksum per {block}-byte block (unsigned 32-bit)")
    if not isinstance(p.get("key"), str):
        fail(f"{at()}: key must be a string")
    return Piece(obj, p["key"], p["offset"], length, br[0], br[1], tuple(crc))
