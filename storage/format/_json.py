"""Bounded JSON for everything a checkpoint holds (manifests, safetensors headers, the hf index,
``ftsdp.values``): decoded whatever its bytes into a value or a ``CorruptCheckpointError``, within
a size and a nesting limit (docs/format.md, "Threat model")."""

from __future__ import annotations

import json
import reprlib
from typing import Any

from ftsdp.storage._errors import CorruptCheckpointError
from ftsdp.storage._options import MAX_JSON_DEPTH, MAX_MANIFEST_BYTES

MAX_INT = 2**63 - 1  # the largest integer the format uses anywhere (sizes, offsets, steps)
_CONTAINERS = frozenset({dict, list})  # what json.loads nests
_SHOW = reprlib.Repr()  # bounded: nesting, lengths and big numbers are elided
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 3, 80, 80, 40


def show(x: Any) -> str:
    """A short repr of a value from a manifest, safe for any nesting or size."""
    try:
        return _SHOW.repr(x)
    except (RecursionError, ValueError):  # pragma: no cover - reprlib bounds both
        return f"<{type(x).__name__}>"


def decode_json(
    data: bytes,
    *,
    where: str,
    what: str,
    max_bytes: int = MAX_MANIFEST_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
) -> Any:
    """The JSON document ``data`` (``what`` at ``where``, for messages): UTF-8, at most
    ``max_bytes`` bytes and ``max_depth`` levels of arrays and objects; CorruptCheckpointError
    otherwise, whatever the bytes."""
    if len(data) > max_bytes:
        raise CorruptCheckpointError(
            f"{where}: {what} of {len(data)} bytes is larger than "
            f"max_manifest_bytes={max_bytes} (LoadOptions)"
        )
    try:
        text = data.decode()  # UTF-8 only (json.loads would also guess UTF-16 and UTF-32)
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where}: {what} is not UTF-8 ({e})") from None
    try:
        doc = json.loads(text)
    except RecursionError:  # the decoder's stack ran out (nesting past ~1000 levels)
        raise CorruptCheckpointError(
            f"{where}: {what} nests JSON arrays or objects too deeply to decode "
            f"(max_json_depth={max_depth})"
        ) from None
    except ValueError as e:  # JSONDecodeError; an integer longer than Python's str limit
        raise CorruptCheckpointError(f"{where}: {what} is not valid JSON ({e})") from None
    if too_deep(doc, max_depth):
        raise CorruptCheckpointError(
            f"{where}: {what} nests JSON arrays or objects deeper than "
            f"max_json_depth={max_depth} (LoadOptions) levels"
        )
    return doc


def too_deep(doc: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels in ``doc`` (one level at a
    time, no recursion)."""
    level = [doc] if type(doc) in _CONTAINERS else []
    for _ in range(limit):
        level = [
            c
            for x in level
            for c in (x.values() if type(x) is dict else x)
            if type(c) in _CONTAINERS
        ]
        if not level:
            return False
    return bool(level)
