"""Fresh host memory for staging and reads (private mappings of their own), and loaded tensors
(advised huge pages).

The first write to fresh memory is where a copy into it spends its time: the kernel faults in
and zeroes each page. In 2 MiB pages it does so 512 times less often, but a process's first
huge pages can cost far more on some machines (docs/benchmarks.md, "First call: what was
slow"): only the tensors a load hands out, which stay, ask for them.
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import torch

_HUGE = 2 << 20  # bytes in a huge page (x86-64 and arm64 with 4 KiB pages)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def host_buffer(nbytes: int, *, populate: bool = False) -> torch.Tensor:
    """A new writable uint8 CPU tensor of ``nbytes`` in a private anonymous mapping of its own
    (``mmap``'s default is a shared one). The mapping goes back to the system when its last
    view goes (a heap block could stay with its thread's arena), so a budget on buffers in
    flight bounds the memory held.

    ``populate`` (Linux): the kernel maps and zeroes every page inside the ``mmap`` call, which
    releases the GIL, rather than on first write. A ranged read asks for it: the S3 client
    writes every body on the one event-loop thread all readers share, which then takes no page
    fault (docs/benchmarks.md, "Checkpoint on S3")."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    private = getattr(mmap, "MAP_PRIVATE", None)  # not on Windows, whose mappings are private
    if private is None:
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    flags = private | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)


class ByteBudget:
    """At most ``limit`` bytes of buffers in flight (a save's staging, a streamed load's reads):
    ``acquire`` blocks until others release enough (a request over the whole budget is admitted
    when nothing else is held: progress)."""

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


def empty_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device="cpu")``, its whole 2 MiB pages advised huge
    before anything is written: an ordinary CPU tensor whose memory torch owns and frees, for
    tensors handed to the caller."""
    t = torch.empty(shape, dtype=dtype, device="cpu")  # whatever the default device
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE * _HUGE
    if _MADV_HUGEPAGE is not None and end > start:
        # no Python call advises memory it did not map itself: libc's madvise; its error
        # (an old kernel, huge pages compiled out) only leaves the pages small
        ctypes.CDLL(None).madvise(
            ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE)
        )
    return t
