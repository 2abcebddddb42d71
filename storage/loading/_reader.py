"""Execute a read plan: concurrent ranged reads verified per part, then one copy into place.

``fetch`` reads and verifies parts of whole checksum blocks on worker threads and writes nothing,
so a load can still fail cleanly; ``Delivery.finish`` then copies into the targets (through the staging
tensors only for a conversion); ``execute`` fills the staging tensors. A load larger than its
in-flight budget streams instead: ``fetch`` hands each verified part to ``Delivery.place``
(docs/format.md, "Loading and resharding").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ftsdp.storage._errors import CorruptCheckpointError, IncompleteCheckpointError
from ftsdp.storage.format._checksum import Checksum, checksum_function
from ftsdp.storage.format._layout import manifest_path, step_dir
from ftsdp.storage.format._manifest import Manifest, Piece
from ftsdp.storage.io._buffers import ByteBudget
from ftsdp.storage.io._fs import Store
from ftsdp.storage.loading._read_plan import Copy, Span, Want

_COPY_CHUNK = 16 << 20  # bytes per copy task, so that one large tensor uses every thread

# (copy, byte offset inside the copy, verified source bytes): a copy may span several parts
Segment = tuple[Copy, int, np.ndarray]


@dataclass
class _Part:
    """Bytes ``[start, end)`` of ``span.object`` holding whole checksum blocks."""

    span: Span
    start: int
    end: int
    blocks: list[tuple[int, int, str, Piece, int]]  # (byte start, byte end, name, piece, k)


def _parts(span: Span, block: int, part_bytes: int) -> list[_Part]:
    """Cut ``span`` at block boundaries into parts of at least ``part_bytes`` (but the last)."""
    blocks = sorted(
        (p.byte_start + k * block, min(p.byte_start + (k + 1) * block, p.byte_end), name, p, k)
        for name, p, k in span.blocks.values()
    )  # disjoint: the manifest's pieces share no byte (checked when it is decoded)
    parts: list[_Part] = []
    current: list[tuple[int, int, str, Piece, int]] = []
    start = span.start
    for b in blocks:
        current.append(b)
        if b[1] - start >= part_bytes:
            parts.append(_Part(span, start, b[1], current))
            start, current = b[1], []
    if start < span.end or not parts:
        parts.append(_Part(span, start, span.end, current))
    else:
        parts[-1].blocks.extend(current)
    return parts


def _fetch_part(store: Store, step: int, check: Checksum, part: _Part) -> list[Segment]:
    rel = f"{step_dir(step)}/{part.span.object}"
    try:  # bytes no one can change once read: the checks and the copies see the same bytes
        data = store.stable_range(rel, part.start, part.end)
    except FileNotFoundError:
        raise _missing(store, step, rel) from None
    for lo, hi, name, piece, k in part.blocks:
        if check(data[lo - part.start : hi - part.start], 0) != piece.checksums[k]:
            raise CorruptCheckpointError(
                f"checksum mismatch in tensor {name!r} (step {step}, object "
                f"{store.where(rel)}, bytes [{lo}, {hi})); the checkpoint is corrupt, "
                "load another step"
            )
    out = []
    for c in part.span.copies:
        lo, hi = max(c.src, part.start), min(c.src + c.nbytes, part.end)
        if hi > lo:
            out.append((c, lo - c.src, data[lo - part.start : hi - part.start]))
    return out


def _missing(store: Store, step: int, rel: str) -> IncompleteCheckpointError:
    """The error for object ``rel`` of ``step``, which its manifest lists and which is gone:
    the whole step removed since it was opened (retention, a discard) when its manifest is gone
    too, else an incomplete step."""
    try:
        removed = not store.exists(manifest_path(step))
    except OSError:
        removed = False  # not known: say what is
    if removed:
        return IncompleteCheckpointError(
            f"step {step} was removed while it was read (its manifest and object "
            f"{store.where(rel)} are gone: retention or a discard deleted the step after it was "
            "opened); load a step that is kept"
        )
    return IncompleteCheckpointError(
        f"step {step}: {store.where(rel)} is missing, yet its manifest lists it: the step is "
        "incomplete; load another step"
    )


def _run(threads: int, tasks: Sequence[Callable[[], object]]) -> list:
    """Run ``tasks`` on up to ``threads`` threads; the first error cancels the rest and raises."""
    if len(tasks) <= 1 or threads <= 1:
        return [t() for t in tasks]
    results: list = [None] * len(tasks)

    def call(i: int) -> None:
        results[i] = tasks[i]()

    with ThreadPoolExecutor(min(threads, len(tasks)), "storage-read") as pool:
        pending = {pool.submit(call, i) for i in range(len(tasks))}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in done:
                    fut.result()
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return results


def fetch(
    store: Store,
    manifest: Manifest,
    spans: list[Span],
    place: Callable[[list[Segment]], object] | None = None,
    inflight_bytes: int = 0,
) -> tuple[list[Segment], int]:
    """Read ``spans`` of ``manifest``'s step and verify every block against the manifest's
    checksums; the source bytes of every copy and the bytes read. With ``place``, each part's
    verified segments go to ``place`` as soon as they are read (none are returned), and at most
    ``inflight_bytes`` are read and not yet placed (but one part, if a part is larger)."""
    step, block = manifest.step, manifest.checksum_block_bytes
    check = checksum_function(manifest.checksum_algorithm)
    threads, part_bytes = store.io.threads, store.io.part_bytes
    if place is not None:  # parts small enough that ``threads`` of them fit in the budget
        part_bytes = min(part_bytes, max(block, inflight_bytes // threads))
    parts = [p for s in spans for p in _parts(s, block, part_bytes)]
    budget = ByteBudget(max(inflight_bytes, 1)) if place is not None else None

    def streamed(p: _Part) -> list[Segment]:
        assert place is not None and budget is not None
        budget.acquire(p.end - p.start)
        try:
            place(_fetch_part(store, step, check, p))
        finally:
            budget.release(p.end - p.start)
        return []

    task = partial(_fetch_part, store, step, check) if place is None else streamed
    results = _run(threads, [partial(task, p) for p in parts])
    segments = [seg for r in results if r for seg in r]
    return segments, sum(s.end - s.start for s in spans)


def copy_tasks(dst: torch.Tensor, c: Copy, off: int, src: np.ndarray) -> list[Callable[[], object]]:
    """Tasks copying ``src``, bytes ``[off, off + len(src))`` of copy ``c``, into ``dst``."""
    if not c.row:
        return _copy_tasks(dst, c.dst_byte + off, src)
    return [partial(_copy_rows, dst, c, off, src)]


def _copy_rows(dst: torch.Tensor, c: Copy, off: int, src: np.ndarray) -> None:
    """``src``, bytes ``[c.lead + off, ...)`` of a run of rows (``c.row`` bytes every
    ``c.stride``), into rows of ``dst`` ``c.pitch`` bytes apart: a head, the whole rows at
    once, a tail."""
    out = dst.detach().numpy() if dst.device.type == "cpu" else None
    row, pitch, stride = c.row, c.pitch, c.stride or c.row

    def put(at: int, data: np.ndarray) -> None:
        if out is not None:
            out[at : at + len(data)] = data
        else:
            dst[at : at + len(data)].copy_(torch.from_numpy(data.copy()))

    r, col = divmod(c.lead + off, stride)
    i = 0
    if col:  # the head: the end of a row (and its gap)
        if col < row:
            put(c.dst_byte + r * pitch + col, src[: min(row - col, len(src))])
        i, r = stride - col, r + 1
    whole = max(len(src) - i - row, -1) // stride + 1 if len(src) - i >= row else 0
    if whole and out is not None:
        view = np.lib.stride_tricks.as_strided
        rows = view(out[c.dst_byte + r * pitch :], (whole, row), (pitch, 1), writeable=True)
        np.copyto(rows, view(src[i:], (whole, row), (stride, 1), writeable=False))
        i, r = i + whole * stride, r + whole
    while len(src) - i >= row:  # off the CPU: row by row
        put(c.dst_byte + r * pitch, src[i : i + row])
        i, r = i + stride, r + 1
    if i < len(src):  # the tail: the start of a row
        put(c.dst_byte + r * pitch, src[i : i + min(row, len(src) - i)])


def _copy_tasks(dst: torch.Tensor, at: int, src: np.ndarray) -> list[Callable[[], object]]:
    """Tasks copying ``src`` into bytes ``[at, at + len(src))`` of the uint8 tensor ``dst``."""
    if dst.device.type != "cpu":
        # not a hot path (staging is on the CPU); torch wants a writable source
        return [lambda: dst[at : at + len(src)].copy_(torch.from_numpy(src.copy()))]
    out = dst.detach().numpy()

    def copy(a: int) -> None:
        np.copyto(out[at + a : at + min(a + _COPY_CHUNK, len(src))], src[a : a + _COPY_CHUNK])

    return [partial(copy, a) for a in range(0, len(src), _COPY_CHUNK)]


class Delivery:
    """Copies of fetched bytes into each ``targets[i]`` (the tensor ``wants[i]`` describes)."""

    def __init__(self, wants: list[Want], targets: list[torch.Tensor]) -> None:
        self.wants, self.targets = wants, targets
        self.direct = [  # the saved bytes can be copied into the target as they are
            t.device.type == "cpu" and t.dtype == w.staging.dtype and t.is_contiguous()
            for w, t in zip(wants, targets, strict=True)
        ]

    def tasks(self, segments: list[Segment]) -> list[Callable[[], object]]:
        """The copies of ``segments`` into the targets (or the staging tensors)."""
        out: list[Callable[[], object]] = []
        for c, off, src in segments:
            t = self.targets[c.want]
            dst = t.detach().reshape(-1).view(torch.uint8) if self.direct[c.want] else c.dst
            out.extend(copy_tasks(dst, c, off, src))
        return out

    def place(self, segments: list[Segment]) -> None:
        """Copy ``segments`` on the calling thread."""
        for task in self.tasks(segments):
            task()

    def finish(self, segments: list[Segment], threads: int) -> None:
        """Copy ``segments`` (none left when streamed), then convert the staged tensors into
        their targets."""
        _run(threads, self.tasks(segments))
        for t, d in zip(self.targets, self.direct, strict=True):
            if d:  # written through numpy: tell autograd, as an in-place copy_ would have
                torch.autograd.graph.increment_version(t)
        converts = [  # detach: grad mode is per thread, and these may be parameters
            lambda w=w, t=t: t.detach().copy_(w.staging.view(t.shape))
            for w, t, d in zip(self.wants, self.targets, self.direct, strict=True)
            if not d
        ]
        _run(threads, converts)


def execute(store: Store, manifest: Manifest, spans: list[Span]) -> int:
    """Read every span (parts of ``store.io.part_bytes``, ``store.io.threads`` in flight), verify
    every block read, fill the staging tensors; the number of bytes read."""
    segments, nbytes = fetch(store, manifest, spans)
    tasks = [t for c, o, src in segments for t in copy_tasks(c.dst, c, o, src)]
    _run(store.io.threads, tasks)
    return nbytes
