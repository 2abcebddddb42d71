"""The one rank spawner of the tests and the benchmarks; the parent never imports torch."""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import pickle
import queue as queue_mod
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import ModuleType
from typing import Any

GRACE_S = 5.0  # after a rank fails, how long the others get to report their own errors


def forkserver_flawed() -> bool:
    """Whether any local user can reach this Python's fork server (CPython 3.10.0-3.10.8 and
    3.11.0, CVE-2022-42919); the launcher's own check, which this room may not import, is
    ``ftsdp.launch.forkserver_is_safe``, and a test holds the two together."""
    v = sys.version_info
    flawed = (v[:2] == (3, 10) and v[2] < 9) or v[:3] == (3, 11, 0)
    return sys.implementation.name == "cpython" and flawed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1, free a moment ago (held together while picked)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _resolve(target: str | bytes) -> Callable:
    """The rank function, from ``"module:function"`` or a pickle of it."""
    if isinstance(target, bytes):
        return pickle.loads(target)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _rank_entry(rank: int, world_size: int, spec: tuple[Any, ...]) -> None:
    port, backend, timeout, threads, env, target, args, results, parent = spec
    if parent is not None:  # forked from the fork server: the caller's environment, as spawned
        environ, cwd = parent
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS=str(threads),
    )
    os.environ.update(env)
    dist: ModuleType | None = None  # torch.distributed once imported
    try:
        import torch
        import torch.distributed

        dist = torch.distributed

        torch.set_num_threads(threads)
        fn = _resolve(target)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        # Every rank's group is connected before any function runs: a rank whose function
        # returns at once would otherwise close its pairs while a peer is still connecting
        # (gloo's "Connection closed by peer" in that peer's init_process_group).
        dist.barrier()
        result = fn(rank, world_size, *pickle.loads(args))
        results.put((rank, True, pickle.dumps(result)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    _exit_quickly(results)


def _exit_quickly(results: Any) -> None:
    """End a rank that has reported without the interpreter's teardown (about a second with
    torch loaded, per rank, at every spawn), when that teardown has nothing left to do: no
    thread to join and no child process to end. The report is flushed first."""
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    if multiprocessing.active_children() or _children():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    results.close()
    results.join_thread()  # the queue's feeder thread has written the report
    os._exit(0)


def _children() -> list[str]:
    """The pids of this process's children (any way they were started)."""
    found: list[str] = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                found += f.read().split()
    return found


def run_ranks(
    fn: Callable | str,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 240.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` (a picklable callable or ``"module:function"``) on fresh
    ranks with a ``backend`` process group (``LOCAL_RANK`` = rank); their results in rank order.
    ``timeout``: seconds for the run and the group; ``threads``: each rank's torch threads;
    ``env``: set last in each rank. A rank that fails or stays silent raises ``RuntimeError``
    (tracebacks, exit codes); ranks are always reaped.

    ``start_method``: ``"spawn"``, a new interpreter per rank (what the benchmarks measure), or
    ``"forkserver"``, a fork of a server process that imported torch once for every later call
    (seconds less per rank). A forked rank gets this process's environment and working directory
    as they are at the call, but what the C runtime read at the server's start (``MALLOC_*``) is
    the server's. Where another local user could reach the fork server (``forkserver_flawed``)
    the ranks are spawned instead."""
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method={start_method!r}: 'spawn' or 'forkserver'")
    if start_method == "forkserver" and forkserver_flawed():
        start_method = "spawn"
    target = fn if isinstance(fn, str) else pickle.dumps(fn)
    parent: tuple[dict[str, str], str] | None = None
    ctx: multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "ftsdp.storage"])
        parent = (dict(os.environ), os.getcwd())
        ctx = multiprocessing.get_context("forkserver")
    else:
        ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    spec = (
        port,
        backend,
        timeout,
        threads,
        dict(env or {}),
        target,
        pickle.dumps(args),
        results,
        parent,
    )
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world_size, spec), name=f"rank{r}")
        for r in range(world_size)
    ]
    got: dict[int, Any] = {}
    failures: dict[int, str] = {}
    codes: dict[int, int | None] = {}  # exit codes as the wait ended (None: still running)
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(got) + len(failures) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                if any(p.is_alive() for p in procs):
                    continue
                # every rank has exited: take what they left in the pipe, then stop
                deadline = min(deadline, time.monotonic() + 0.5)
                continue
            if ok:
                got[rank] = payload
            else:
                failures[rank] = payload
                # The other ranks are likely stuck in a collective with the failed one: give
                # them a moment to report their own errors, then stop waiting.
                deadline = min(deadline, time.monotonic() + GRACE_S)
    finally:
        # Ranks that reported exit on their own; wait a little (all together), then kill.
        settle = time.monotonic() + (GRACE_S if len(got) == world_size else 0.5)
        for r, p in enumerate(procs):
            if p.pid is not None:
                p.join(timeout=max(settle - time.monotonic(), 0.0))
                codes[r] = p.exitcode
                if p.is_alive():
                    p.kill()
                    p.join()
        results.close()
    missing = sorted(set(range(world_size)) - set(got) - set(failures))
    if failures or missing:
        name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))
        lines = [f"run_ranks: {world_size} {backend} rank(s) of {name}"]
        if failures:
            lines.append(f"rank(s) {sorted(failures)} raised")
        if missing:
            exits = {r: codes.get(r) for r in missing}
            lines.append(
                f"rank(s) {missing} did not report within {timeout:g}s, or {GRACE_S:g}s after "
                f"a failure (exit codes {exits}; None: still running, killed): a hang or a crash"
            )
        for r in sorted(failures):
            lines.append(f"--- rank {r} ---\n{failures[r]}")
        raise RuntimeError("\n".join(lines))
    return [pickle.loads(got[r]) for r in range(world_size)]
