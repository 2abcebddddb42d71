"""Streaming under a memory budget: chunk sizes, chunked requests, progress.

[Note: the memory budget] (docs/cli.md, "Memory"): work is cut into requests of at most
``chunk_bytes`` and read, cast and written one group of requests at a time."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

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
        return math.prod(self.shape)

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


def piece_bytes(t: torch.Tensor, start: int, length: int) -> memoryview:
    """The raw bytes of elements ``[start, start + length)`` of ``t``: for a contiguous CPU
    tensor a view of its memory holding no reference to ``t`` (the caller keeps ``t`` alive and
    unchanged meanwhile), else a copy. ValueError for a range outside the tensor."""
    if start < 0 or length < 0 or start + length > t.numel():
        raise ValueError(
            f"elements [{start}, {start + length}) of a tensor of {t.numel()} elements: the "
            "saved tensor changed size after save() (only optimizer.step() may change it, and "
            "only in place)"
        )
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() or not length:
        t = t.detach().resolve_conj().resolve_neg()
        return tensor_bytes(t.reshape(-1)[start : start + length])
    size = t.element_size()
    n = length * size
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr() + start * size)).cast("B")


def tensor_bytes(t: torch.Tensor | memoryview) -> memoryview:
    """The raw bytes of a tensor (a view of a contiguous CPU one: writing into them fills it);
    a memoryview is returned as it is."""
    if isinstance(t, memoryview):
        return t
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return t.contiguous().view(-1).view(torch.uint8).numpy().data.cast("B")
