"""Stress overwriting retired objects against concurrent readers: does a loader ever see bytes
that are not a saved step's?

    python -m ftsdp.tools.dev.stress_reuse --seconds 60 --readers 3

One process saves step after step with ``keep_last=1`` and ``SaveOptions(reuse_retired=True)``,
so that every save retires the previous step and the next one overwrites its object: the most
churn the option can produce. Each step's state is a function of the step alone. Reader
processes meanwhile load the newest step (``storage.load``, which maps the objects, verifies
every block and only then copies) or an older one they listed, in a loop, and check each load
against the state of the step it reports. A load may fail while its step is retired under it
(``CheckpointError``, ``FileNotFoundError``: counted as raced); it must never return another
step's bytes, or bytes of no step. A reader also keeps one object of a step open and mapped for
a while, and compares its bytes before and after: they must not change (see [Note: overwriting
a retired object] in ``storage/io/_fs.py``).

Prints the saves, how many objects were overwritten in place, the loads (exact / raced) and the
held mappings checked, and exits 1 on any wrong load or changed mapping. ``--json PATH`` writes
the counts for tests.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from ftsdp import storage

SHAPES = {"w": (256, 128), "b": (1000,), "h": (3, 5000)}


def state_of(step: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step``: a function of the step alone."""
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}


def _empty() -> dict[str, torch.Tensor]:
    return {k: torch.empty(*shape) for k, shape in SHAPES.items()}


def _held_mapping_stays(root: str, step: int) -> bool | None:
    """Map one object of ``step``, read it, wait while saves go on, read it again: whether the
    bytes stayed (None when the step was gone before it could be mapped)."""
    try:
        manifest = storage.catalog.read_manifest(root, step)
        path = os.path.join(root, f"step-{step}", sorted(manifest.objects)[0])
        fd = os.open(path, os.O_RDONLY)
    except (storage.CheckpointError, FileNotFoundError, OSError):
        return None
    try:
        held = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        before = bytes(held)
        time.sleep(0.05)
        return bytes(held) == before
    finally:
        held.close()


def reader(root: str, stop: Any, seed: int, out: Any) -> None:
    """Load in a loop until ``stop``; put the counts on ``out`` (after a first None: ready)."""
    counts = {"exact": 0, "raced": 0, "wrong": 0, "held": 0, "changed": 0}
    torch.set_num_threads(1)
    out.put(None)
    i = seed
    while not stop.is_set():
        i += 1
        target = _empty()
        try:
            steps = storage.list_steps(root) if i % 3 == 0 else []
            step = steps[0] if steps else None  # the oldest listed, or the newest
            result = storage.load(target, root, step)
        except (storage.CheckpointError, FileNotFoundError, ValueError):
            counts["raced"] += 1
            continue
        want = state_of(result.step)
        exact = all(torch.equal(target[k], want[k]) for k in SHAPES)
        counts["exact" if exact else "wrong"] += 1
        if i % 7 == 0 and result.step is not None:
            stayed = _held_mapping_stays(root, result.step)
            if stayed is not None:
                counts["held"] += 1
                counts["changed"] += not stayed
    out.put(counts)


def _inodes(root: str, step: int) -> set[int]:
    manifest = storage.catalog.read_manifest(root, step)
    return {os.stat(os.path.join(root, f"step-{step}", n)).st_ino for n in manifest.objects}


def run(seconds: float, readers: int, root: str) -> dict[str, Any]:
    """Save step after step under ``root`` for ``seconds`` while ``readers`` processes load (the
    clock starts once they are ready); the counts.
    ``reused``: objects of a step whose inode is one of the step two saves before it (the one
    the previous save retired): on tmpfs, which never hands out an inode number twice, an
    object overwritten in place."""
    options = storage.SaveOptions(reuse_retired=True, keep_last=1)
    storage.save(state_of(1), root, 1, options=options)
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=reader, args=(root, stop, 1000 * r, out)) for r in range(readers)]
    for p in procs:
        p.start()
    inodes = {1: _inodes(root, 1)}
    reused, step = 0, 1
    try:
        _gather(out, procs, lambda _: None)  # every reader is ready
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step += 1
            storage.save(state_of(step), root, step, options=options)
            inodes[step] = _inodes(root, step)
            reused += len(inodes[step] & inodes.pop(step - 2, set()))
    finally:
        stop.set()
    totals = {"saves": step, "reused": reused}

    def add(counts: dict[str, int]) -> None:
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v

    _gather(out, procs, add)
    for p in procs:
        p.join(timeout=60)
    return totals


def _gather(out: Any, procs: list[Any], take: Any) -> None:
    """One message from every reader, passed to ``take``; RuntimeError when a reader died."""
    got = 0
    while got < len(procs):
        try:
            take(out.get(timeout=1))
            got += 1
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a reader died (exit codes {dead})") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60, help="how long to save, step after step")
    p.add_argument("--readers", type=int, default=3, help="reader processes")
    p.add_argument("--dir", default="/dev/shm", help="parent of the checkpoint root")
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ftsdp-stress-reuse-", dir=args.dir)
    try:
        totals = run(args.seconds, args.readers, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{totals['saves']} saves, {totals['reused']} objects overwritten in place; loads: "
        f"{totals['exact']} exact, {totals['raced']} raced (step retired under the load), "
        f"{totals['wrong']} wrong; held mappings: {totals['held']} checked, "
        f"{totals['changed']} changed"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(totals, f)
    return 1 if totals["wrong"] or totals["changed"] else 0


if __name__ == "__main__":
    sys.exit(main())
