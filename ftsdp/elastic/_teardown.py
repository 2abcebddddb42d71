"""Leaving the process groups without aborting the process at exit (docs/elastic.md, "Teardown")."""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

WORKER_THREAD_NAMES = ("pt_gloo_runloop",)  # ProcessGroupGloo's worker threads (torch >= 2.6)
_TASKS = "/proc/self/task"
_SAMPLE_S = 0.005
_QUIET_S = 0.03  # idle this long (6 GIL switch intervals) counts as idle


@dataclass
class CloseReport:
    """What :func:`close_process_groups` did (for logs and tests)."""

    barrier_s: float | None = None  # seconds in the barrier; None: skipped
    barrier_error: str | None = None  # why the barrier failed (a peer gone or late)
    destroyed: int = 0  # process groups destroyed (world included)
    still_referenced: int = 0  # of those, still alive after gc (held by a model)
    idle_wait_s: float = 0.0  # waiting for their worker threads to be idle
    idle: bool = True  # False: a worker thread was still busy at the deadline
    busy_threads: list[str] = field(default_factory=list)


def _registered_groups() -> list[Any]:
    """Every process group this process is a member of, in creation order (world first)."""
    world = dist.group.WORLD
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    groups = [pg for pg in (names or {}) if pg is not world]
    return [world, *groups] if world is not None else groups


def _leave_together(device: torch.device, timeout_s: float) -> None:
    """One barrier per process group, one deadline, in creation order (the same on every rank)."""
    deadline = time.monotonic() + timeout_s
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    for pg in _registered_groups():
        if pg.size() == 1:
            continue
        left = max(deadline - time.monotonic(), 0.001)
        opts = dist.BarrierOptions()
        opts.timeout = timedelta(seconds=left)  # gloo's barrier ends at it by itself
        if cuda:
            opts.device_ids = [device.index if device.index is not None else 0]
        pg.barrier(opts).wait(timedelta(seconds=left + 5.0))
    if cuda:
        torch.cuda.synchronize(device)


def _thread_states(names: tuple[str, ...]) -> dict[str, str] | None:
    """``{"tid name": state}`` of this process's threads named ``names``; None without /proc."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return None
    states: dict[str, str] = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        if name.startswith(names):
            states[f"{tid} {name}"] = stat[stat.rfind(")") + 2 :].split(" ", 1)[0]
    return states


def wait_for_idle_workers(
    timeout_s: float = 5.0, names: tuple[str, ...] = WORKER_THREAD_NAMES
) -> tuple[bool, float, list[str]]:
    """Sleep until the threads named ``names`` have been blocked for ``_QUIET_S`` in a row (no
    /proc: sleep that once); ``(idle, seconds waited, busy threads at the deadline)``."""
    start = time.monotonic()
    deadline = start + timeout_s
    quiet_since: float | None = None
    while True:
        states = _thread_states(names)
        now = time.monotonic()
        if states is None:
            time.sleep(_QUIET_S)
            return True, time.monotonic() - start, []
        if not states:
            return True, now - start, []
        busy = sorted(t for t, s in states.items() if s != "S")
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= _QUIET_S:
            return True, now - start, []
        if now >= deadline:
            return False, now - start, [f"{t} ({states[t]})" for t in busy]
        time.sleep(_SAMPLE_S)


def _destroy_all() -> list[weakref.ref]:
    """Destroy the subgroups (newest first), then the world; weak references to them (a
    function of its own, so that no strong reference of ours outlives it)."""
    groups = _registered_groups()
    refs = [weakref.ref(pg) for pg in groups]
    for subgroup in reversed(groups[1:]):
        dist.destroy_process_group(subgroup)
    dist.destroy_process_group()
    return refs


def close_process_groups(
    device: torch.device,
    *,
    barrier: bool = True,
    barrier_timeout_s: float = 60.0,
    idle_timeout_s: float = 5.0,
) -> CloseReport:
    """Leave together (``barrier``), destroy every process group and wait for their gloo workers
    to be idle; ``barrier=False`` (after an error) skips the barrier and the garbage collection."""
    report = CloseReport()
    if not dist.is_initialized():
        return report
    if barrier and dist.get_world_size() > 1:
        t0 = time.monotonic()
        try:
            _leave_together(device, barrier_timeout_s)
        except Exception as e:  # a peer gone or late: go on closing, say so
            report.barrier_error = f"{type(e).__name__}: {e}"
            logger.warning(
                f"rank {dist.get_rank()}: not every rank reached close() within "
                f"{barrier_timeout_s:.0f} s ({report.barrier_error.splitlines()[0][:300]}); "
                "closing without them. A peer that failed or hung is the likely cause (see its log)."
            )
        report.barrier_s = time.monotonic() - t0
    rank = dist.get_rank()
    refs = _destroy_all()
    report.destroyed = len(refs)
    if barrier:
        gc.collect()
    report.still_referenced = sum(ref() is not None for ref in refs)
    report.idle, report.idle_wait_s, report.busy_threads = wait_for_idle_workers(idle_timeout_s)
    if not report.idle:
        logger.warning(
            f"rank {rank}: close() destroyed the process groups, but {report.still_referenced} "
            f"of them are still referenced (by a model?) and their worker threads "
            f"{report.busy_threads} were still busy after {idle_timeout_s:.1f} s: the process may "
            "abort at exit. Call close() when no collective is in flight (after the last one "
            "was waited for)."
        )
    logger.debug("close_process_groups: %s", report)
    return report
