"""Fresh host memory for staging and reads: an anonymous mapping of its own, in huge pages."""

from __future__ import annotations

import contextlib
import mmap

import torch


def host_buffer(nbytes: int) -> torch.Tensor:
    """A new writable uint8 CPU tensor of ``nbytes`` in a private anonymous mapping of its own.

    The mapping goes back to the system when its last view goes (a heap block could stay with
    its thread's arena), and Linux backs it with 2 MiB pages where transparent huge pages are
    enabled (the usual ``madvise`` mode): the first write then faults in and zeroes 512 times
    fewer pages. That first write is the larger part of copying into fresh memory, and of the
    first async save's blocking (docs/benchmarks.md, "First call").
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; a kernel without huge pages refuses it
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)
