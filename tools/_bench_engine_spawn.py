"""Spawn the ranks of one ``tools/bench_engine.py`` run without importing torch here.

The parent only plans runs and prints tables, so it never imports torch (a few seconds on a
loaded machine); each rank imports it, joins a fresh process group (gloo, or NCCL on GPU) and
calls the rank function named ``"module:function"``.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

RANK_MAIN = "ftsdp.tools._bench_engine_ranks:rank_main"


def _entry(rank: int, world: int, port: int, cfg: dict, q: Any, target: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    backend = "nccl" if cfg["device"] == "cuda" else "gloo"
    try:
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout"])
        )
        q.put((rank, True, fn(rank, world, cfg)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, cfg: dict[str, Any], target: str = RANK_MAIN) -> list[Any]:
    """``target(rank, world, cfg)`` on ``world`` fresh processes: the per-rank results in rank
    order, or a RuntimeError with every failed rank's traceback (also for a hang past
    ``cfg["timeout"]`` seconds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, cfg, q, target)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + cfg["timeout"]
    try:
        while len(results) + len(errors) < world and time.monotonic() < deadline:
            try:
                rank, ok, payload = q.get(timeout=0.5)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if ok:
                results[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                deadline = min(deadline, time.monotonic() + 5)  # the others may be stuck
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors or len(results) < world:
        missing = sorted(set(range(world)) - set(results))
        raise RuntimeError(
            f"world size {world}, {cfg['device']}: ranks {missing} failed or did not finish "
            f"within {cfg['timeout']:.0f}s\n" + "\n".join(errors)
        )
    return [results[r] for r in range(world)]
