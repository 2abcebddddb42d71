"""Host-memory staging for async save: a byte budget with back-pressure, and the copy itself."""

from __future__ import annotations

import threading

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


def stage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of 1-D tensors (pinned when they live on CUDA), complete when this returns."""
    out, cuda = [], False
    for t in tensors:
        t = t.detach()
        if t.device.type == "cuda":
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            cuda = True
        else:
            buf = t.clone(memory_format=torch.contiguous_format)
        out.append(buf)
    if cuda:
        torch.cuda.synchronize()
    return out
