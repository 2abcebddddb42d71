"""Where a unit's collectives run relative to the computation that uses them. [Note: streams]
host work handles, or CUDA side streams ordered by events (docs/engine.md, "Streams on CUDA"):
a unit makes every side-stream allocation inside ``issue``, after the side stream waited."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Waitable(Protocol):
    """An async collective's handle: a ``dist.Work``, or several waited for as one."""

    def wait(self) -> object: ...


Issue = Callable[[], "Waitable | None"]  # allocates, casts, and starts one collective


class HostSchedule:
    """Async work handles; waiting blocks the caller (CPU / gloo). The base of every schedule."""

    def gather(self, issue: Issue) -> Any:
        """Run ``issue`` (allocate the full buffer, cast, start the all-gather); a token."""
        return issue()

    def reduce(self, issue: Issue) -> Any:
        """Run ``issue`` (cast the gradient, start its reduction); a token."""
        return issue()

    def wait(self, token: Any) -> None:
        """From here on, computation sees the collective behind ``token`` complete."""
        if token is not None:
            token.wait()

    def freed(self) -> None:
        """A unit's full buffer was just freed (the rate limiter counts these)."""

    def synchronize(self) -> None:
        """Block the CPU until the computation queued so far is done (host copies landed)."""


class StreamSchedule(HostSchedule):
    """Gather and reduce streams ordered by events (CUDA); ``api``: ``torch.cuda`` or a stand-in."""

    def __init__(
        self, device: torch.device, *, api: Any = None, limit_all_gathers: bool = True
    ) -> None:
        self.api = torch.cuda if api is None else api
        self.device = device
        # High priority, as the paper suggests: communication should not queue behind compute.
        self.gather_stream = self.api.Stream(device=device, priority=-1)
        self.reduce_stream = self.api.Stream(device=device, priority=-1)
        self.limit = 2 if limit_all_gathers else None  # frees outstanding (docs/engine.md)
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


def schedule_for(device: torch.device, *, limit_all_gathers: bool = True) -> HostSchedule:
    """The schedule for ``device``: streams on CUDA, work handles everywhere else."""
    if device.type == "cuda":
        return StreamSchedule(device, limit_all_gathers=limit_all_gathers)
    return HostSchedule()
