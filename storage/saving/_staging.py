"""Host-memory staging for async save: a byte budget with back-pressure, and the copy itself."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ftsdp.storage.io._buffers import host_buffer

_ALIGN = 64  # bytes: every staged piece starts aligned for any dtype


def stage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of 1-D tensors, packed into one uint8 buffer (pinned when a tensor lives on
    CUDA), complete when this returns."""
    total = sum(aligned_bytes(t.numel() * t.element_size()) for t in tensors)
    cuda = any(t.device.type == "cuda" for t in tensors)
    out = copy_into(tensors, _fresh(total, pinned=cuda))
    if cuda:
        torch.cuda.synchronize()
    return out


class SnapshotArena:
    """Where snapshots put a rank's share, kept for the next save (``reuse_staging=False`` frees
    it); one save of the lane uses it at a time. From CUDA: one pinned buffer the share is packed
    into. On the CPU: one tensor per leaf (:meth:`leaves`), made on the caller's thread."""

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        # (layout, tensors, their bytes): the bytes' views made once, not at every save
        self._leaves: tuple[Any, list[torch.Tensor], list[memoryview]] | None = None
        self._lock = threading.Lock()
        # copy_into's views of the kept buffer, by layout: valid while that buffer is kept
        self.layouts: dict[Any, tuple[list[torch.Tensor], list[memoryview]]] = {}

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of exactly ``nbytes`` (a view of the kept one when it is big
        enough), for a copy from CUDA."""
        with self._lock:
            if self._pinned is None or self._pinned.numel() < nbytes:
                self._pinned = None  # free the small one before allocating
                self.layouts.clear()  # their views would keep it alive
                self._pinned = _fresh(nbytes, pinned=True)  # (resident already)
            return self._pinned[:nbytes]

    def leaves(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[memoryview]]:
        """CPU tensors of the dtypes and sizes of the 1-D ``tensors``, to copy them into, and
        their bytes: the kept ones when those are the same, else new ones. Call it on the
        thread that trains, whose malloc arena holds what the process freed (docs/benchmarks.md,
        "First call: what was slow, and what changed", 2026-12-04)."""
        layout = tuple((t.dtype, t.numel()) for t in tensors)
        with self._lock:
            if self._leaves is None or self._leaves[0] != layout:
                self._leaves = None  # free the old ones before allocating
                into = [torch.empty(n, dtype=d) for d, n in layout]
                raw = [t.view(torch.uint8).numpy().data for t in into]
                self._leaves = layout, into, raw
            return self._leaves[1], self._leaves[2]

    def reserve(self, tensors: list[torch.Tensor], nbytes: int, pinned: bool) -> None:
        """Make the memory the next snapshot of ``tensors`` (``nbytes`` packed) takes, its pages
        touched."""
        if pinned:
            self.pinned(nbytes)
        else:
            _touch([t.view(torch.uint8) for t in self.leaves(tensors)[0] if t.numel()])

    def held_bytes(self) -> int:
        """Bytes kept, all kinds."""
        with self._lock:
            kept = [] if self._leaves is None else list(self._leaves[1])
            kept += [] if self._pinned is None else [self._pinned]
            return sum(t.numel() * t.element_size() for t in kept)

    def clear(self) -> None:
        """Drop the kept buffers."""
        with self._lock:
            self._pinned = self._leaves = None
            self.layouts.clear()


def _fresh(nbytes: int, pinned: bool) -> torch.Tensor:
    """New host memory: pinned for copies from CUDA, else a private mapping of its own."""
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return host_buffer(nbytes)


def _touch(bufs: list[torch.Tensor]) -> None:
    """Map the pages of uint8 CPU tensors: one write per page, in parts on several threads."""
    n = max(1, min(_COPY_THREADS, sum(b.numel() for b in bufs) // _BYTES_PER_THREAD))
    groups: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for i, b in enumerate(bufs):
        groups[i % n].append(b[::4096])
    _on_threads([lambda g=g: [p.fill_(0) for p in g] for g in groups if g])


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
    """Copy 1-D ``tensors`` into ``buf`` at aligned offsets (CUDA ones on ``stream``, synchronised
    here); the views (``as_bytes``: memoryviews), kept in ``layouts`` for the next copy of the same
    dtypes and sizes (docs/elastic.md, "Saves that do not stop training")."""
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
        copy_cpu(views, tensors)
    return list(raw if as_bytes else views)


# A large host copy (and the page faults of fresh memory) runs in parts of at least
# _BYTES_PER_THREAD on up to _COPY_THREADS threads: page faults proceed in parallel
# (docs/benchmarks.md, "Where the first async save lost").
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
_COPY_THREADS = min(8, _CPUS or 1)
_BYTES_PER_THREAD = 16 << 20


def copy_cpu(views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
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
