"""Host-memory staging for async save: a byte budget with back-pressure, and the copy itself."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ftsdp.storage.format._objects import PlannedObject


class StagingBudget:
    """At most ``limit`` bytes staged at once; ``acquire`` blocks until uploads release enough.

    A request larger than the whole budget is admitted when nothing else is held, so a save
    always makes progress (it then stages one object at a time).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used > 0 and self.used + n > self.limit:
                self._cond.wait()
            self.used += n
            self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


_ALIGN = 64  # bytes: every staged piece starts aligned for any dtype


class StagingPool:
    """Host buffers of finished async saves, handed to the next one.

    Periodic saves of the same state stage the same object sizes every time, so the buffers fit
    again; reusing them saves the page faults of fresh memory (about two thirds of the copy's
    time on CPU) and, on CUDA, the expensive allocation of pinned memory. At most ``limit``
    bytes are kept (the save's staging budget), of the sizes the latest save used;
    ``SaveOptions(reuse_staging=False)`` empties it.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes``: a kept one of that size, else a new one."""
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                self._bytes -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buf: torch.Tensor, limit: int) -> None:
        """Keep ``buf`` for a later save unless that would hold more than ``limit`` bytes."""
        with self._lock:
            if self._bytes + buf.numel() <= limit:
                self._free.setdefault((buf.numel(), buf.is_pinned()), []).append(buf)
                self._bytes += buf.numel()

    def clear(self, keep: set[tuple[int, bool]] | frozenset = frozenset()) -> None:
        """Drop the kept buffers, except those of the ``(nbytes, pinned)`` kinds in ``keep``."""
        with self._lock:
            for kind in [k for k in self._free if k not in keep]:
                self._bytes -= kind[0] * len(self._free.pop(kind))


def stage(
    tensors: list[torch.Tensor], pool: StagingPool | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:  # (1D copies, the uint8 buffer holding them)
    """Host copies of 1-D tensors, packed into one uint8 buffer (pinned when a tensor lives on
    CUDA; from ``pool`` when given), complete when this returns: the copies and the buffer."""
    total = sum(aligned_bytes(t.numel() * t.element_size()) for t in tensors)
    cuda = any(t.device.type == "cuda" for t in tensors)
    buf = pool.take(total, cuda) if pool is not None else None
    if buf is None:
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    out = copy_into(tensors, buf)
    if cuda:
        torch.cuda.synchronize()
    return out, buf


class SnapshotArena:
    """One host buffer per kind (pinned or not) that deferred snapshots pack a rank's pieces into.

    A deferred save copies the whole share of a rank at once (it must be complete before the
    next optimizer step), so it takes one buffer of at least that size and keeps it for the next
    save: periodic saves of the same state then copy into memory that is already mapped.
    :meth:`reserve` allocates ahead of the first save and touches every page, so that the first
    snapshot is as fast as the later ones. One save uses the arena at a time (``save`` waits
    for the previous one to commit before it starts).
    """

    def __init__(self) -> None:
        self._bufs: dict[bool, torch.Tensor] = {}
        self._lock = threading.Lock()
        # copy_into's views of the kept buffers, by layout: valid while those buffers are kept
        self.layouts: dict[Any, tuple[list[torch.Tensor], list[memoryview]]] = {}

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 buffer of exactly ``nbytes`` (a view of the kept one when it is big enough)."""
        with self._lock:
            buf = self._bufs.get(pinned)
            if buf is None or buf.numel() < nbytes:
                self._bufs.pop(pinned, None)  # free the small one before allocating
                self.layouts.clear()  # their views would keep it alive
                buf = _touched(nbytes, pinned)
                self._bufs[pinned] = buf
            return buf[:nbytes]

    def reserve(self, nbytes: int, pinned: bool) -> None:
        """Make sure the kept buffer of this kind holds at least ``nbytes``, pages touched."""
        self.take(nbytes, pinned)

    def held_bytes(self) -> int:
        """Bytes kept, all kinds."""
        with self._lock:
            return sum(b.numel() for b in self._bufs.values())

    def clear(self) -> None:
        """Drop the kept buffers."""
        with self._lock:
            self._bufs.clear()
            self.layouts.clear()


def _touched(nbytes: int, pinned: bool) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if not pinned:  # pinned memory is resident already; fresh pageable memory is not
        pages = buf[::4096]  # one write per page maps it, in parts on several threads
        n = max(1, min(_COPY_THREADS, nbytes // _BYTES_PER_THREAD))
        _on_threads([lambda p=p: p.fill_(0) for p in pages.tensor_split(n)])
    return buf


def staged_bytes(obj: PlannedObject) -> int:
    """Host memory an object's pieces take when staged (each at the staging alignment)."""
    return sum(aligned_bytes(p.length * p.dtype.itemsize) for p in obj.pieces)


def aligned_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to the staging alignment."""
    return -(-nbytes // _ALIGN) * _ALIGN


def copy_into(
    tensors: list[torch.Tensor],
    buf: torch.Tensor,
    stream: Any = None,
    layouts: dict[Any, tuple[list[torch.Tensor], list[memoryview]]] | None = None,
    *,
    as_bytes: bool = False,
) -> list[Any]:
    """Copy 1-D ``tensors`` into ``buf`` packed at aligned offsets; returns the views (with
    ``as_bytes``, memoryviews of their bytes, which is what a writer wants).

    CUDA tensors are copied on ``stream`` when given (a ``torch.cuda.Stream``, non-blocking),
    which is synchronised before this returns; CPU tensors in one batched copy. ``layouts`` (a
    dict the caller keeps as long as ``buf``'s memory, such as ``SnapshotArena.layouts``) keeps
    the views, so that the next copy of the same dtypes and sizes into the same buffer reuses
    them: see [Note: the snapshot copy's cost].
    """
    key = (buf.data_ptr(), buf.numel(), tuple((t.dtype, t.numel()) for t in tensors))
    kept = None if layouts is None else layouts.get(key)
    if kept is None:
        whole = buf.numpy().data.cast("B")
        views, raw, off = [], [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            views.append(buf[off : off + nbytes].view(t.dtype))
            raw.append(whole[off : off + nbytes])
            off += aligned_bytes(nbytes)
        kept = views, raw
        if layouts is not None:
            if len(layouts) >= _LAYOUTS_KEPT:  # layouts of other saves: start afresh
                layouts.clear()
            layouts[key] = kept
    views, raw = kept
    if any(t.device.type != "cpu" for t in tensors):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        if stream is not None:
            stream.synchronize()
    else:
        _copy_cpu(views, tensors)
    return list(raw if as_bytes else views)


# [Note: a large host copy on several threads]
# The staging copy of an async save runs on the caller's thread, and a first save copies into
# fresh memory: every page is faulted in and zeroed by the kernel as the copy first writes it,
# which costs more than the copy itself. Page faults in different parts of a buffer and the
# copies after them proceed in parallel, so a copy of at least ``_BYTES_PER_THREAD`` per thread
# is cut into that many parts of about equal bytes (a large tensor split among them), copied
# at once by up to ``_COPY_THREADS`` threads, the caller's among them (and so are the pages of
# the snapshot arena mapped by ``_touched``); torch releases the GIL inside its ops. Smaller
# copies stay one batched call: a thread's start would cost more than it saves.
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
_COPY_THREADS = min(8, _CPUS or 1)
_BYTES_PER_THREAD = 16 << 20


def _copy_cpu(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    """``views[i].copy_(tensors[i])`` for 1-D CPU tensors, on several threads when large."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    n = min(_COPY_THREADS, total // _BYTES_PER_THREAD)
    with torch.no_grad():
        if n < 2:
            torch._foreach_copy_(views, tensors)
            return
        share = -(-total // n)
        parts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(n)]
        k, room = 0, share
        for view, t in zip(views, tensors, strict=True):
            size, start, numel = t.element_size(), 0, t.numel()
            while start < numel:
                take = min(numel - start, max(1, room // size))
                parts[k][0].append(view[start : start + take])
                parts[k][1].append(t[start : start + take])
                start, room = start + take, room - take * size
                if room < size and k < n - 1:
                    k, room = k + 1, share
    _on_threads([lambda p=p: _foreach_copy(*p) for p in parts if p[0]])


def _foreach_copy(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread
        torch._foreach_copy_(views, tensors)


def _on_threads(jobs: list[Any]) -> None:
    """Run the callables ``jobs`` at once, the first on the caller's thread; raise the first
    error."""
    if len(jobs) < 2:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(len(jobs) - 1, "storage-copy") as pool:
        futures = [pool.submit(job) for job in jobs[1:]]
        jobs[0]()
        for f in futures:
            f.result()


_LAYOUTS_KEPT = 256  # objects per rank and save whose views are kept (a few hundred bytes each)


# [Note: the snapshot copy's cost]
# A rank's share of a state is a few hundred tensors: one view of the flat parameter per
# parameter, one per optimizer state tensor, one 1-element step counter each. Copied one by
# one from Python, the slicing, views and checks cost several times the memcpy itself. The
# views into a kept buffer are the same from one save to the next when the layout is, so they
# are made once; the copy is then one ``torch._foreach_copy_`` (torch's batched copy, a C++
# loop of ``copy_``). The writer gets memoryviews of the staged bytes, also made once per
# layout, instead of turning each tensor into bytes again (detach, views, numpy).
