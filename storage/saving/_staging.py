"""Host-memory staging for async save: a byte budget with back-pressure, and the copy itself."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


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


def stage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of 1-D tensors, packed into one uint8 buffer (pinned when a tensor lives on
    CUDA), complete when this returns."""
    total = sum(aligned_bytes(t.numel() * t.element_size()) for t in tensors)
    cuda = any(t.device.type == "cuda" for t in tensors)
    out = copy_into(tensors, torch.empty(total, dtype=torch.uint8, pin_memory=cuda))
    if cuda:
        torch.cuda.synchronize()
    return out


class SnapshotArena:
    """One host buffer per kind (pinned or not) that deferred snapshots pack a rank's pieces into.

    An async save copies the whole share of a rank at once, so it takes one buffer of at least
    that size and keeps it for the next save: periodic saves of the same state then copy into
    memory that is already mapped (``SaveOptions(reuse_staging=False)`` frees it after each
    save). A new buffer has every page touched before the copy, on several threads;
    ``prepare_save`` does that ahead of the first save. One save uses the arena at a time
    (``save`` waits for the previous one to commit before it starts).
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
        if not tensors:
            return
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
