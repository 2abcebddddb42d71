"""Hang and silent-rank detection through heartbeats in the c10d store.

[Note: heartbeat vs progress]
Every rank's watchdog thread writes ``"<beats> <step>"`` under its rank's key every
``interval_s`` and reads every peer's key. Two different failures show up differently:

- a rank that is **stopped or gone** (SIGSTOP, kill -9, a lost node) stops beating: its
  ``beats`` does not change for ``heartbeat_timeout_s``;
- a rank that is **alive but stuck** (a hung collective, an endless loop) keeps beating, but the
  job's progress (the largest ``step``) does not change for ``progress_timeout_s``; the ranks at
  the lowest step are named (all of them, if every rank shows the same step).

Staleness is measured on the observer's own monotonic clock from the moment it last saw the
value change, so hosts need no synchronised clocks. On detection the watchdog logs one line per
stalled rank (``rank R stalled at step S for T s``), SIGKILLs stalled ranks on its own host
(the agent would otherwise wait 30 s for a stopped process to die before restarting the group),
and exits the process with ``EXIT_STALL`` so that torchrun restarts the group, instead of every
survivor waiting for the collective timeout. A rank that finishes writes ``closed`` so its
silence afterwards is not a stall. The store itself being unreachable for
``heartbeat_timeout_s`` counts as a failure too (the agent hosting it is gone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

EXIT_STALL = 86
_CLOSED = b"closed"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stall:
    """One stalled rank as a watchdog saw it."""

    rank: int
    step: int
    seconds: float
    kind: str  # "heartbeat" (stopped or gone), "progress" (alive, no step) or "store"

    def __str__(self) -> str:
        what = {
            "heartbeat": "no heartbeat",
            "progress": "no progress",
            "store": "c10d store unreachable",
        }[self.kind]
        return f"rank {self.rank} stalled at step {self.step} for {self.seconds:.1f} s ({what})"


class Watchdog:
    """A daemon thread publishing this rank's heartbeat and checking its peers'.

    ``store``: a c10d store shared by the ranks (``RankManager.store("watchdog")``); keys are
    ``hb/<rank>``. ``peers``: optional ``(host, pid)`` per rank, to SIGKILL a stalled peer on
    this host. ``on_stall(stalls)`` replaces the default action (log, kill, ``os._exit``).
    ``log``: one-line messages (default: the ``ftsdp.elastic._watchdog`` logger, at ERROR).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        interval_s: float = 1.0,
        heartbeat_timeout_s: float = 30.0,
        progress_timeout_s: float | None = None,
        peers: Sequence[tuple[str, int]] | None = None,
        on_stall: Callable[[list[Stall]], None] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if interval_s <= 0 or heartbeat_timeout_s <= interval_s:
            raise ValueError(
                f"Watchdog: need 0 < interval_s={interval_s} < "
                f"heartbeat_timeout_s={heartbeat_timeout_s}"
            )
        if progress_timeout_s is not None and progress_timeout_s <= 0:
            raise ValueError(f"Watchdog: progress_timeout_s={progress_timeout_s} must be > 0")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s = interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.peers = list(peers) if peers is not None else None
        self._on_stall = on_stall
        self._log = log or logger.error
        self._step = 0
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # an unexpected failure of the thread itself
        self.stalls: list[Stall] = []

    def _key(self, rank: int) -> str:
        return f"hb/{rank}"

    def beat(self, step: int) -> None:
        """Record progress: the main loop calls this at every step boundary (no I/O here)."""
        self._step = step

    def start(self) -> Watchdog:
        """Publish the first heartbeat and start checking (idempotent)."""
        if self._thread is None:
            self._publish()
            self._thread = threading.Thread(target=self._run, name="ftsdp-watchdog", daemon=True)
            self._thread.start()
        return self

    def _publish(self) -> None:
        self._beats += 1
        self.store.set(self._key(self.rank), f"{self._beats} {self._step}")

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # surfaced through .error and the log, never silent
            self.error = e
            self._log(f"ftsdp watchdog on rank {self.rank} failed: {type(e).__name__}: {e}")

    def _loop(self) -> None:
        keys = [self._key(r) for r in range(self.world_size)]
        start = time.monotonic()
        seen: dict[int, tuple[bytes, float]] = {}  # rank -> (last value, when it changed)
        steps: dict[int, int] = {}
        progress = (-1, start)  # (largest step seen, when it changed)
        store_ok = start
        try:  # every rank publishes once at start; a rank that never does is a stall too
            self.store.wait(keys, timedelta(seconds=self.heartbeat_timeout_s))
        except Exception:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if missing:
                now = time.monotonic()
                stalls = [Stall(r, 0, now - start, "heartbeat") for r in missing]
                self._fire(stalls, " (never seen)")
                return
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._publish()
                values = dict(zip(keys, self.store.multi_get(keys), strict=True))
                store_ok = now
            except Exception as e:
                if now - store_ok > self.heartbeat_timeout_s:
                    self._fire(
                        [Stall(self.rank, self._step, now - store_ok, "store")],
                        f" ({type(e).__name__}: {e})",
                    )
                    return
                continue
            stalls: list[Stall] = []
            live: list[int] = []
            for r in range(self.world_size):
                value = values.get(self._key(r))
                if value == _CLOSED:
                    continue
                live.append(r)
                if r == self.rank:
                    steps[r] = self._step
                    continue
                last = seen.get(r)
                if value is not None and (last is None or last[0] != value):
                    seen[r] = (value, now)
                    steps[r] = int(value.split()[1])
                    continue
                since = last[1] if last is not None else start
                if now - since > self.heartbeat_timeout_s:
                    stalls.append(Stall(r, steps.get(r, 0), now - since, "heartbeat"))
            top = max((steps.get(r, 0) for r in live), default=0)
            if top != progress[0]:
                progress = (top, now)
            elif (
                not stalls
                and self.progress_timeout_s is not None
                and now - progress[1] > self.progress_timeout_s
            ):
                low = min(steps.get(r, 0) for r in live)
                stalls = [
                    Stall(r, steps.get(r, 0), now - progress[1], "progress")
                    for r in live
                    if steps.get(r, 0) == low
                ]
            if stalls:
                self._fire(stalls, "")
                return

    def _fire(self, stalls: list[Stall], detail: str) -> None:
        self.stalls = stalls
        if self._on_stall is not None:
            self._on_stall(stalls)
            return
        for s in stalls:
            self._log(f"ftsdp watchdog (rank {self.rank}): {s}{detail}; exiting with {EXIT_STALL}")
        self._kill_local(stalls)
        os._exit(EXIT_STALL)

    def _kill_local(self, stalls: list[Stall]) -> None:
        if self.peers is None:
            return
        host = socket.gethostname()
        for s in stalls:
            if s.kind == "store" or not 0 <= s.rank < len(self.peers):
                continue
            peer_host, pid = self.peers[s.rank]
            if peer_host == host and pid != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    self._log(
                        f"ftsdp watchdog (rank {self.rank}): killed rank {s.rank} (pid {pid})"
                    )

    def close(self) -> None:
        """Stop the thread and mark this rank closed, so peers do not take it for a stall."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
        with contextlib.suppress(Exception):
            self.store.set(self._key(self.rank), _CLOSED)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
