"""Host-memory staging for async save: a byte budget with back-pressure, and the copy itself."""

from __future__ import annotations

import threading

import numpy as np
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
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    cuda = any(t.device.type == "cuda" for t in tensors)
    buf = pool.take(total, cuda) if pool is not None else None
    if buf is None:
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        view = buf[off : off + nbytes].view(t.dtype)  # 1D
        if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            # a plain memcpy: about 1.5x faster than torch's elementwise copy kernel
            np.copyto(buf[off : off + nbytes].numpy(), t.view(torch.uint8).numpy())
        else:
            view.copy_(t, non_blocking=cuda)
        out.append(view)
    if cuda:
        torch.cuda.synchronize()
    return out, buf
