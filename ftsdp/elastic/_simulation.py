"""The watchdog at scale, simulated: W watchdogs' real per-interval code in one process over an
in-memory store, the clock simulated (docs/elastic.md, "Watchdog", "At scale")."""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from ftsdp.elastic._watchdog import Stall, Watchdog


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _CountingStore:
    """One rank's client of a simulated store (a shared dict), counting calls and keys."""

    def __init__(self, data: dict[str, bytes]) -> None:
        self.data = data
        self.calls = 0
        self.keys = 0

    def _count(self, keys: int) -> None:
        self.calls += 1
        self.keys += keys

    def _value(self, key: str) -> bytes:
        try:
            return self.data[key]
        except KeyError:
            raise LookupError(f"simulated store: no key {key!r}") from None

    def set(self, key: str, value: str | bytes) -> None:
        self._count(1)
        self.data[key] = _bytes(value)

    def get(self, key: str) -> bytes:
        self._count(1)
        return self._value(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count(len(keys))
        return [self._value(k) for k in keys]

    def add(self, key: str, amount: int) -> int:
        self._count(1)
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def append(self, key: str, value: str | bytes) -> None:
        self._count(1)
        self.data[key] = self.data.get(key, b"") + _bytes(value)

    def check(self, keys: list[str]) -> bool:
        self._count(len(keys))
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count(len(keys))
        for k in keys:
            self._value(k)


def simulate_heartbeats(
    world_size: int,
    intervals: int = 3,
    local_world_size: int = 8,
    *,
    kill: Iterable[int] = (),
    hang: Iterable[int] = (),
    closed: Iterable[int] = (),
    interval_s: float = 1.0,
    heartbeat_timeout_s: float = 30.0,
    progress_timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run ``world_size`` watchdogs' real per-interval code in this process on a counting
    in-memory store, the clock simulated (docs/elastic.md, "Watchdog", "At scale").

    After ``intervals`` measured healthy intervals the ``closed`` ranks close, the ``kill`` ranks
    stop beating and the ``hang`` ranks (needs ``progress_timeout_s``) stay one step behind a
    job that stops progressing; intervals run until every survivor acted, or three past the
    timeout. Returns a dict of store calls and keys per interval (``ops_per_interval``,
    ``max_ops_per_rank``, ...), ``detect_intervals`` / ``act_intervals`` (first / last survivor
    acting after the fault; ``today_detect_intervals`` for a watchdog reading every peer), the
    stalls acted on (``named``, ``kinds``) and counts. Raises ValueError for bad arguments.
    """
    if world_size < 1 or intervals < 1 or local_world_size < 1:
        raise ValueError(
            f"simulate_heartbeats: need world_size={world_size}, intervals={intervals} and "
            f"local_world_size={local_world_size} all >= 1"
        )
    kill, hang, closed = set(kill), set(hang), set(closed)
    if bad := sorted(r for r in kill | hang | closed if not 0 <= r < world_size):
        raise ValueError(f"simulate_heartbeats: ranks {bad} are not in [0, {world_size})")
    data: dict[str, bytes] = {}
    stores = [_CountingStore(data) for _ in range(world_size)]
    acted: dict[int, tuple[int, list[Stall]]] = {}
    dogs = [
        Watchdog(
            stores[r],
            r,
            world_size,
            interval_s=interval_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            progress_timeout_s=progress_timeout_s,
            local_world_size=local_world_size,
            log=lambda _: None,
        )
        for r in range(world_size)
    ]

    def counted() -> tuple[list[int], list[int]]:
        calls, keys = [s.calls for s in stores], [s.keys for s in stores]
        for s in stores:
            s.calls = s.keys = 0
        return calls, keys

    def run_interval(k: int, ranks: list[int]) -> None:
        now = k * interval_s
        for r in ranks:
            dogs[r]._publish()
        for r in ranks:
            if stalls := dogs[r]._interval(now, publish=False):
                acted[r] = (k, stalls)

    for d in dogs:
        d._publish()
        d._begin(0.0)
    if never := [s for d in dogs for s in d._await_targets()]:
        raise RuntimeError(f"simulate_heartbeats: ranks never seen at startup: {never}")
    startup_ops = sum(counted()[0])
    everyone = list(range(world_size))
    per_interval: list[tuple[list[int], list[int]]] = []
    spent = 0.0
    for k in range(1, intervals + 1):
        for d in dogs:
            d.beat(k)
        t = time.perf_counter()
        run_interval(k, everyone)
        spent += time.perf_counter() - t
        per_interval.append(counted())
    healthy_acted = dict(acted)
    for r in sorted(closed):
        dogs[r].close()
    survivors = [r for r in everyone if r not in kill | closed]
    last_change = intervals  # the killed ranks' last beat
    detect = today = act = None
    timeout = heartbeat_timeout_s  # a killed or closed rank: its heartbeats stop
    if hang:
        if progress_timeout_s is None:
            raise ValueError("simulate_heartbeats: hang= needs progress_timeout_s")
        if not kill:  # a hung rank beats on, without progress
            timeout = progress_timeout_s
        for r in survivors:
            dogs[r].beat(intervals if r in hang else intervals + 1)
        if any(r not in hang for r in survivors):
            last_change = intervals + 1  # the ranks ahead finish one more step, then wait
    window = 1  # the first interval whose observer saw the change more than timeout ago
    while (last_change + window) * interval_s - last_change * interval_s <= timeout:
        window += 1
    k = intervals
    while (kill or hang or closed) and k < last_change + window + 3:
        if all(r in acted for r in survivors):
            break
        k += 1
        if not (kill or hang):  # only closed ranks: the others go on training
            for r in survivors:
                dogs[r].beat(k)
        run_interval(k, [r for r in survivors if r not in acted])
    if kill or hang:
        today = window
        first = [acted[r][0] for r in survivors if r in acted]
        if first:
            detect = min(first) - last_change
            if len(first) == len(survivors):
                act = max(first) - last_change
    fault_ops = sum(counted()[0])
    named = sorted({s.rank for _, stalls in acted.values() for s in stalls})
    kinds = sorted({s.kind for _, stalls in acted.values() for s in stalls})
    return {
        "world_size": world_size,
        "local_world_size": local_world_size,
        "ops_per_interval": max(sum(c) for c, _ in per_interval),
        "keys_per_interval": max(sum(n) for _, n in per_interval),
        "max_ops_per_rank": max(max(c) for c, _ in per_interval),
        "max_keys_per_rank": max(max(n) for _, n in per_interval),
        "seconds_per_interval_per_rank": spent / (intervals * world_size),
        "startup_ops": startup_ops,
        "healthy_stalls": sum(len(s) for _, s in healthy_acted.values()),
        "detect_intervals": detect,
        "today_detect_intervals": today,
        "act_intervals": act,
        "fault_ops": fault_ops,
        "named": named,
        "kinds": kinds,
        "acted": len([r for r in survivors if r in acted]),
        "survivors": len(survivors),
    }
