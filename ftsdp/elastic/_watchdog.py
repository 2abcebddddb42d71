"""Hang and silent-rank detection by heartbeats in the c10d store (docs/elastic.md, "Watchdog")."""

from __future__ import annotations

import contextlib
import functools
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
_WATCHED = 2  # peers each rank reads per interval
_SUM = "hb/sum"  # sum of the ranks' steps + _ALARM x alarms raised
_ALARM_KEY = "hb/alarm"  # one line per stalled rank: "rank step seconds kind seen_by"
_CLAIM = "hb/claim"  # the first rank to see a progress stall names the ranks behind
_ALARM = 1 << 44
# A stall's kind -> what its log line says.
_KINDS = {"heartbeat": "no heartbeat", "progress": "no progress", "store": "c10d store unreachable"}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stall:
    """One stalled rank as a watchdog saw it; ``seen_by``: the watching rank (None: unknown)."""

    rank: int
    step: int
    seconds: float
    kind: str  # "heartbeat" (stopped or gone), "progress" (alive, no step) or "store"
    seen_by: int | None = None

    def __str__(self) -> str:
        what = _KINDS[self.kind]
        # (the step its last heartbeat reported: a heartbeat goes out once an interval, so the
        # rank may have gone on for a few steps after it)
        return (
            f"rank {self.rank} stalled for {self.seconds:.1f} s ({what}); its last heartbeat "
            f"reported step {self.step}"
        )


@functools.lru_cache(maxsize=8)
def _ring_of(hosts: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The watch ring over ``hosts`` (one entry per rank) and each rank's position in it."""
    first: dict[Any, int] = {}
    index: list[int] = []
    seen: dict[Any, int] = {}
    for h in hosts:
        first.setdefault(h, len(first))
        index.append(seen.get(h, 0))
        seen[h] = index[-1] + 1
    # the first rank of every host (hosts in order of their lowest rank), then the second, ...
    ring = tuple(sorted(range(len(hosts)), key=lambda r: (index[r], first[hosts[r]])))
    return ring, tuple(sorted(range(len(ring)), key=ring.__getitem__))  # rank -> position


@functools.lru_cache(maxsize=8)
def _numbered_hosts(world_size: int, local_world_size: int) -> tuple[int, ...]:
    """Host numbers of torchrun's contiguous ranks (each rank alone for 1: rank order)."""
    return tuple(r // local_world_size for r in range(world_size))


def _step_of(value: bytes) -> int:
    try:
        return int(value.split()[1])
    except (IndexError, ValueError):
        return 0


class Watchdog:
    """A daemon thread publishing this rank's heartbeat and checking a few peers' (docs/elastic.md,
    "Watchdog"). ``store``: a c10d store of the ranks (``RankManager.store("watchdog")``);
    ``peers``: ``(host, pid)`` per rank, to watch peers on other hosts and SIGKILL a stalled one on
    this host by pidfd (without: ``local_world_size`` ranks per host); ``on_stall(stalls)``
    replaces the default action (log, kill, ``os._exit``); ``log``: default this module's logger
    at ERROR; ``agent_check`` runs first in every interval (``RankManager.exit_if_orphaned``)."""

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
        local_world_size: int | None = None,
        agent_check: Callable[[], None] | None = None,
    ) -> None:
        if interval_s <= 0 or heartbeat_timeout_s <= interval_s:
            raise ValueError(
                f"Watchdog: need 0 < interval_s={interval_s} < "
                f"heartbeat_timeout_s={heartbeat_timeout_s}"
            )
        if progress_timeout_s is not None and progress_timeout_s <= 0:
            raise ValueError(f"Watchdog: progress_timeout_s={progress_timeout_s} must be > 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"Watchdog: rank={rank} must be in [0, world_size={world_size})")
        if local_world_size is not None and local_world_size < 1:
            raise ValueError(f"Watchdog: local_world_size={local_world_size} must be >= 1")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.heartbeat_timeout_s = interval_s, heartbeat_timeout_s
        self.progress_timeout_s = progress_timeout_s
        self.peers = list(peers) if peers is not None else None
        self._pidfds = self._open_local_peers()
        self._on_stall = on_stall
        self._agent_check = agent_check or (lambda: None)
        self._log = log or logger.error
        self._step = self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # an unexpected failure of the thread itself
        self.stalls: list[Stall] = []
        hosts = (
            tuple(h for h, _ in self.peers)
            if self.peers is not None and len(self.peers) == world_size
            else _numbered_hosts(world_size, local_world_size or 1)
        )
        self._ring, pos = _ring_of(hosts)
        self._pos = pos[rank]
        self._reach = 0  # ring positions ahead of this rank already taken as targets
        self._targets: list[int] = []
        for _ in range(min(_WATCHED, world_size - 1)):
            self._adopt()
        # per-interval state (set by _begin): when each target's value last changed, etc.
        self._t0: float | None = None
        self._store_ok = 0.0
        self._seen: dict[int, tuple[bytes | None, float]] = {}
        self._steps: dict[int, int] = {}
        self._progress: tuple[int | None, float] = (None, 0.0)
        self._reported = 0  # this rank's step as already added to hb/sum
        self._claimed = False  # the progress stall is another rank's (or nobody's) to name
        self._claim_won = False
        self._detail = ""

    @property
    def watching(self) -> list[int]:
        """The ranks whose heartbeats this watchdog reads now."""
        return list(self._targets)

    def _key(self, rank: int) -> str:
        return f"hb/{rank}"

    def _adopt(self) -> int | None:
        """Take the next rank along the ring as a target (None once the ring is exhausted)."""
        if self._reach >= self.world_size - 1:
            return None
        self._reach += 1
        r = self._ring[(self._pos + self._reach) % self.world_size]
        self._targets.append(r)
        return r

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
        self._agent_check()
        self._begin(time.monotonic())
        if stalls := self._await_targets():
            self._raise_alarm(stalls)
            self._fire(stalls, " (never seen)")
            return
        while not self._stop.wait(self.interval_s):
            self._agent_check()  # first: a store the agent hosted may be gone with it
            if stalls := self.beat_once():
                self._fire(stalls, self._detail)
                return

    def _begin(self, now: float) -> None:
        self._t0 = self._store_ok = now
        self._progress = (None, now)

    def _await_targets(self) -> list[Stall]:
        """Wait for the first heartbeat of the watched ranks; the ones that never came."""
        start = self._t0 if self._t0 is not None else time.monotonic()
        keys = [self._key(r) for r in self._targets]
        if not keys:
            return []
        try:  # every rank publishes once at start; a rank that never does is a stall too
            self.store.wait(keys, timedelta(seconds=self.heartbeat_timeout_s))
            return []
        except Exception:
            missing = [r for r in self._targets if not self.store.check([self._key(r)])]
            now = time.monotonic()
            return [Stall(r, 0, now - start, "heartbeat", self.rank) for r in missing]

    def beat_once(self, now: float | None = None) -> list[Stall]:
        """One interval's work at monotonic ``now``: the stalls found or announced, if any."""
        return self._interval(time.monotonic() if now is None else now, publish=True)

    def _interval(self, now: float, *, publish: bool) -> list[Stall]:
        if self._t0 is None:
            self._begin(now)
        self._detail = ""
        watched = list(self._targets)
        try:
            if publish:
                self._publish()
            values = self.store.multi_get([self._key(r) for r in watched]) if watched else []
            delta = self._step - self._reported
            total = int(self.store.add(_SUM, delta))
            self._reported += delta
        except Exception as e:
            if now - self._store_ok > self.heartbeat_timeout_s:
                self._detail = f" ({type(e).__name__}: {e})"
                return [Stall(self.rank, self._step, now - self._store_ok, "store", self.rank)]
            return []
        self._store_ok = now
        return self._evaluate(now, dict(zip(watched, values, strict=True)), total)

    def _evaluate(self, now: float, values: dict[int, bytes], total: int) -> list[Stall]:
        stalls: list[Stall] = []
        for r, value in values.items():
            if value == _CLOSED:  # finished: watch the next rank along the ring instead
                self._targets.remove(r)
                new = self._adopt()
                if new is not None:
                    self._seen[new] = (None, now)
                continue
            last = self._seen.get(r)
            if last is not None and last[0] is None:  # just adopted: its clock runs from then
                last = self._seen[r] = (value, last[1])
                self._steps[r] = _step_of(value)
            elif last is None or last[0] != value:
                self._seen[r] = (value, now)
                self._steps[r] = _step_of(value)
                continue
            if now - last[1] > self.heartbeat_timeout_s:
                stalls.append(
                    Stall(r, self._steps.get(r, 0), now - last[1], "heartbeat", self.rank)
                )
        alarms, steps = divmod(total, _ALARM)
        if steps != self._progress[0]:
            self._progress = (steps, now)
        elif (
            not stalls
            and not self._claimed
            and self.progress_timeout_s is not None
            and now - self._progress[1] > self.progress_timeout_s
        ):
            stalls = self._progress_stalls(now)
        if stalls:
            self._raise_alarm(stalls, raised=alarms > 0)
        if alarms > 0:
            named = {s.rank for s in stalls}
            stalls += [s for s in self._read_alarm() if s.rank not in named]
        return stalls

    def _progress_stalls(self, now: float) -> list[Stall]:
        """No progress: the first rank to claim it names the ranks at the lowest step."""
        keys = [self._key(r) for r in range(self.world_size)]
        try:
            if not self._claim_won:
                if int(self.store.add(_CLAIM, 1)) != 1:
                    self._claimed = True  # another rank names them: wait for its alarm
                    return []
                self._claim_won = True
            if not self.store.check(keys):
                self._claimed = True  # a rank never started: its watchers name it
                return []
            values = self.store.multi_get(keys)
        except Exception:
            return []  # the store failed: try again next interval
        steps = {r: _step_of(v) for r, v in enumerate(values) if v != _CLOSED}
        steps[self.rank] = self._step
        low = min(steps.values())
        seconds = now - self._progress[1]
        return [
            Stall(r, s, seconds, "progress", self.rank)
            for r, s in sorted(steps.items())
            if s == low
        ]

    def _raise_alarm(self, stalls: list[Stall], *, raised: bool = False) -> None:
        """Tell every rank: append the stalls to hb/alarm, then flag hb/sum (best effort)."""
        lines = "".join(
            f"{s.rank} {s.step} {s.seconds:.3f} {s.kind} {self.rank}\n"
            for s in stalls
            if s.kind != "store"
        )
        if not lines:
            return
        with contextlib.suppress(Exception):
            self.store.append(_ALARM_KEY, lines)
            if not raised:
                self.store.add(_SUM, _ALARM)

    def _read_alarm(self) -> list[Stall]:
        try:
            text = bytes(self.store.get(_ALARM_KEY)).decode(errors="replace")
        except Exception:
            return []
        stalls: dict[int, Stall] = {}
        for line in text.splitlines():
            parts = line.split()
            with contextlib.suppress(ValueError):
                rank, step, seconds, kind, by = parts
                if kind in _KINDS:
                    stall = Stall(int(rank), int(step), float(seconds), kind, int(by))
                    stalls.setdefault(stall.rank, stall)
        return list(stalls.values())

    def _fire(self, stalls: list[Stall], detail: str) -> None:
        self.stalls = stalls
        if self._on_stall is not None:
            self._on_stall(stalls)
            return
        for s in stalls:
            by = f" (seen by rank {s.seen_by})" if s.seen_by not in (None, self.rank) else ""
            self._log(
                f"ftsdp watchdog (rank {self.rank}): {s}{detail}{by}; exiting with {EXIT_STALL}"
            )
        self._kill_local(stalls)
        os._exit(EXIT_STALL)

    def _open_local_peers(self) -> dict[int, int]:
        """rank -> a pidfd of each peer on this host, opened now while the peer is alive: a pidfd
        names one process, so after the peer exits and its pid is reused, signalling it kills
        nothing (a bare pid would kill the newcomer). No pidfds here: no kills, only the exit."""
        fds: dict[int, int] = {}
        if self.peers is None:
            return fds
        host = socket.gethostname()
        for rank, (peer_host, pid) in enumerate(self.peers):
            if peer_host == host and pid != os.getpid() and rank != self.rank:
                try:
                    fds[rank] = os.pidfd_open(pid)
                except (AttributeError, OSError):  # no pidfds (not Linux 5.3+) or already gone
                    continue
        return fds

    def _kill_local(self, stalls: list[Stall]) -> None:
        for s in stalls:
            fd = self._pidfds.get(s.rank) if s.kind != "store" else None
            if fd is None or self.peers is None:
                continue
            with contextlib.suppress(OSError):  # ESRCH: it has exited; the pid is not looked at
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                self._log(
                    f"ftsdp watchdog (rank {self.rank}): killed rank {s.rank} "
                    f"(pid {self.peers[s.rank][1]})"
                )

    def close(self) -> None:
        """Stop the thread and mark this rank closed, so peers do not take it for a stall."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
        with contextlib.suppress(Exception):
            self.store.set(self._key(self.rank), _CLOSED)
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
