"""Spawn a real gloo process group for tests.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises a gloo process
group in each (a fresh TCP rendezvous on 127.0.0.1), calls ``fn(rank, world_size, *args)`` and
returns the list of per-rank return values (which must be picklable: tensors, numbers, dicts).
A failure on any rank is re-raised in the test with that rank's traceback; a rank that does not
finish within ``timeout`` seconds fails the test instead of hanging it.

Spawning costs a couple of seconds per process (importing torch), so a test module spawns once
and runs its grid of cases inside ``fn``.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = payload
        else:
            failures.append(f"--- rank {rank} ---\n{payload}")
            # The other ranks are likely stuck in a collective with the failed one: give them
            # a moment to report their own errors, then stop waiting.
            deadline = min(deadline, time.monotonic() + 5.0)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if failures:
        raise AssertionError("distributed test failed:\n" + "\n".join(failures))
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(
            f"ranks {missing} did not report within {timeout}s (exit codes {codes}): "
            "a hang or a crash"
        )
    return [results[r] for r in range(world_size)]
