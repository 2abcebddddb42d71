"""Where a unit's collectives run relative to the computation that uses them.

[Note: streams]
Two schedules, one interface (``gather``, ``reduce``, ``wait``, ``freed``); a unit never asks
which one it has.

- :class:`HostSchedule` (CPU, and any device without streams): collectives are issued with
  ``async_op=True``; the token is the work handle and ``wait`` blocks the calling thread until
  the collective is done. gloo runs collectives on its own threads, so the next unit's
  all-gather proceeds while autograd computes the current one.

- :class:`StreamSchedule` (CUDA, the paper's Section 4.3): the all-gather (with the shard's
  host-to-device copy and cast before it) runs on a dedicated *gather* stream and every
  reduce-scatter on a dedicated *reduce* stream; an event recorded on the side stream is the
  token, and ``wait`` makes the *compute* stream (the caller's current stream) wait on it, so
  the CPU never blocks on communication. The orderings that keep memory safe:

  * the gather stream waits for the compute stream before each all-gather: the shard is
    up to date (an optimizer step wrote it), and a full buffer freed by compute (whose block
    the caching allocator hands back to the gather stream, where it was allocated) is no longer
    being read when the next all-gather overwrites it;
  * the reduce stream waits for the compute stream before each reduce-scatter: the unit's
    flat gradient is complete. The gradient stays referenced until the compute stream has
    waited on the reduction's event, so its block is not reused while the reduction reads it;
  * every side-stream allocation (full buffer, cast shard, gradient cast, reduce output)
    happens inside ``issue``, after that wait: a unit must not allocate for a side stream
    anywhere else;
  * CPU offload copies each reduced gradient shard to pinned host memory without blocking;
    the runtime synchronizes once at the end of backward, before the optimizer can read them;
  * the rate limiter (``limit_all_gathers``): the CPU runs ahead of the GPU, and without a
    bound it would allocate the full buffers of many future units before the GPU frees any.
    Each reshard records an event on the compute stream; before a new all-gather allocates,
    the CPU waits for the oldest such event once ``max_pending_frees`` are outstanding, which
    keeps at most that many all-gathers' memory in flight.

The stream API is a constructor argument (``torch.cuda`` by default) so the orchestration can
be exercised where no GPU exists (tests pass a recording stand-in).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Waitable(Protocol):
    """An async collective's handle: a ``dist.Work``, or several waited for as one."""

    def wait(self) -> object: ...


Issue = Callable[[], "Waitable | None"]  # allocates, casts, and starts one collective


class Schedule(Protocol):
    """How a unit runs its collectives (see [Note: streams])."""

    def gather(self, issue: Issue) -> Any:
        """Run ``issue`` (allocate the full buffer, cast, start the all-gather); a token."""

    def reduce(self, issue: Issue) -> Any:
        """Run ``issue`` (cast the gradient, start its reduction); a token."""

    def wait(self, token: Any) -> None:
        """From here on, computation sees the collective behind ``token`` complete."""

    def freed(self) -> None:
        """A unit's full buffer was just freed (the rate limiter counts these)."""

    def synchronize(self) -> None:
        """Block the CPU until the computation queued so far is done (host copies landed)."""


class HostSchedule:
    """Async work handles; waiting blocks the caller (CPU / gloo)."""

    def gather(self, issue: Issue) -> Any:
        return issue()

    def reduce(self, issue: Issue) -> Any:
        return issue()

    def wait(self, token: Any) -> None:
        if token is not None:
            token.wait()

    def freed(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class StreamSchedule:
    """Dedicated gather and reduce streams ordered by events (CUDA)."""

    def __init__(
        self,
        device: torch.device,
        *,
        api: Any = None,
        limit_all_gathers: bool = True,
        max_pending_frees: int = 2,
    ) -> None:
        if max_pending_frees < 1:
            raise ValueError(f"max_pending_frees must be >= 1, got {max_pending_frees}")
        self.api = torch.cuda if api is None else api
        self.device = device
        # High priority, as the paper suggests: communication should not queue behind compute.
        self.gather_stream = self.api.Stream(device=device, priority=-1)
        self.reduce_stream = self.api.Stream(device=device, priority=-1)
        self.limit = max_pending_frees if limit_all_gathers else None
        self._frees: deque[Any] = deque()  # events recorded on the compute stream at reshard

    def _compute(self) -> Any:
        return self.api.current_stream(self.device)

    def _run_on(self, stream: Any, issue: Issue) -> Any:
        stream.wait_stream(self._compute())
        with self.api.stream(stream):
            work = issue()
            if work is not None:
                work.wait()  # the side stream (not the CPU) waits for the collective
            return stream.record_event()

    def gather(self, issue: Issue) -> Any:
        if self.limit is not None:
            while len(self._frees) >= self.limit:
                self._frees.popleft().synchronize()
        return self._run_on(self.gather_stream, issue)

    def reduce(self, issue: Issue) -> Any:
        return self._run_on(self.reduce_stream, issue)

    def wait(self, token: Any) -> None:
        if token is not None:
            self._compute().wait_event(token)

    def freed(self) -> None:
        if self.limit is not None:
            self._frees.append(self._compute().record_event())

    def synchronize(self) -> None:
        self._compute().synchronize()


def schedule_for(device: torch.device, *, limit_all_gathers: bool = True) -> Schedule:
    """The schedule for ``device``: streams on CUDA, work handles everywhere else."""
    if device.type == "cuda":
        return StreamSchedule(device, limit_all_gathers=limit_all_gathers)
    return HostSchedule()
