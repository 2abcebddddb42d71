"""Streaming under a memory budget: chunk sizes, chunked requests, progress, atomic writes.

[Note: the memory budget]
Conversions, verification and diffs never hold a whole checkpoint: work is cut into requests of at
most ``chunk_bytes`` (a budget's eighth, see ``chunk_bytes``) and read, cast and written one group
of requests at a time. In flight at once: the read buffers of one group (its bytes plus at most
two checksum blocks per piece), the staging tensors of the group, their cast copies (up to 2x when
a cast widens), and the writer's buffer. A source that can only read whole items (a DCP item, a
non-contiguous tensor in a torch file) needs the largest such item on top.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

MiB = 1 << 20
DEFAULT_MAX_MEMORY = 256 * MiB
MIN_MAX_MEMORY = 8 * MiB

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def chunk_bytes(max_memory: int) -> int:
    """The request size for a budget: an eighth of it, whole MiB, at least 1 MiB."""
    if not isinstance(max_memory, int) or max_memory < MIN_MAX_MEMORY:
        raise ValueError(
            f"max_memory={max_memory!r} is too small; it must be at least {MIN_MAX_MEMORY} bytes "
            "(8 MiB)"
        )
    return max(MiB, max_memory // 8 // MiB * MiB)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a checkpoint as a reader sees it: name, global shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Request:
    """Elements ``[offset, offset + length)`` of the source tensor ``name``."""

    name: str
    offset: int
    length: int


def split_request(name: str, offset: int, length: int, itemsize: int, chunk: int) -> list[Request]:
    """``[offset, offset + length)`` cut into requests of at most ``chunk`` bytes (>= 1 element)."""
    step = max(1, chunk // itemsize)
    return [
        Request(name, o, min(step, offset + length - o))
        for o in range(offset, offset + length, step)
    ]


def group_requests(
    requests: list[Request], itemsizes: dict[str, int], chunk: int
) -> Iterator[list[Request]]:
    """Consecutive requests grouped so that each group holds at most ``chunk`` bytes (or one)."""
    group: list[Request] = []
    used = 0
    for r in requests:
        nbytes = r.length * itemsizes[r.name]
        if group and used + nbytes > chunk:
            yield group
            group, used = [], 0
        group.append(r)
        used += nbytes
    if group:
        yield group


class Meter:
    """Counts bytes against a total and reports them to an optional ``progress`` callback."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total, self.done, self._progress = total, 0, progress
        if progress is not None:
            progress(0, total)

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self._progress is not None:
            self._progress(self.done, self.total)


def url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """``(filesystem, path)`` of a URL (fsspec); the path without a trailing slash."""
    fs, path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    return fs, path.rstrip("/") or path


def is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def read_range_into(fs: Any, path: str, start: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of ``path`` from ``start`` on."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
    end = start + len(view)
    if not len(view):
        return
    if is_local(fs):
        with open(path, "rb") as f:
            f.seek(start)
            got = f.readinto(view)
    else:
        data = fs.cat_file(path, start=start, end=end)
        got = len(data)
        view[:got] = data
    if got != end - start:
        raise OSError(
            f"short read of {path} bytes [{start}, {end}): got {got}; the file is truncated"
        )


@contextlib.contextmanager
def atomic_write(fs: Any, path: str, block_size: int = 8 * MiB) -> Iterator[IO[bytes]]:
    """Write ``path`` so that it exists only complete: a temporary name renamed on a local disk,
    an upload that is discarded (never completed) on an object store when the body raises."""
    if is_local(fs):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)  # make the rename itself durable
        finally:
            os.close(fd)
        return
    f = fs.open(path, "wb", block_size=max(block_size, 5 * MiB))
    try:
        yield f
    except BaseException:
        # Closing would complete the upload and publish a partial object: abort it, and mark
        # the file closed so that its finalizer does not try to finish it either.
        with contextlib.suppress(Exception):
            if hasattr(f, "discard"):
                f.discard()
                f.closed = True
        raise
    f.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()).cast("B")
