"""What a process keeps for its saves to a root (the snapshot memory, threads, storage's own
gloo group, what it learned of the root) is let go by ``storage.saving.release`` and by
``CheckpointManager.close()``: a process that saves to many roots (a sweep, a notebook) does not
grow with their number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving import _save

pytestmark = pytest.mark.timeout(180)


def test_release_lets_go_of_a_roots_threads_and_memory(tmp_path) -> None:
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    for i in range(5):
        url = str(tmp_path / f"root{i}")
        storage.save(state, url, 1, async_save=True).wait()
        storage.save(state, url, 2, async_save=True, defer_copy=True).wait()
        lane = _save._lanes[Store(url, None).where()]
        workers = list(lane._workers.values())
        assert lane.arena.held_bytes() > 0 and lane._writers is not None and workers
        storage.saving.release(url)
        assert Store(url, None).where() not in _save._lanes
        assert lane.arena.held_bytes() == 0 and lane._writers is None
        deadline = time.monotonic() + 10  # each worker's thread ends once told to
        while any(w._running for w in workers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(w._running for w in workers)
    url = str(tmp_path / "root0")  # a later save makes them again
    storage.save({"w": state["w"] + 1}, url, 3, async_save=True).wait()
    assert torch.equal(storage.load_state_dict(url)["w"], state["w"] + 1)
    storage.saving.release(url)


def _run(script: str, *args: str) -> dict:
    """The JSON last line of ``script`` run in a fresh interpreter (it makes a process group)."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_MANY_ROOTS = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch, torch.distributed as dist
    import ftsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())

    def counts():
        return len(os.listdir("/proc/self/fd")), threading.active_count()

    seen = []
    for i in range(int(sys.argv[2])):
        with ftsdp.CheckpointManager(
            f"{sys.argv[1]}/run{i}", model, opt, memory_url=f"{sys.argv[1]}/mem{i}",
            memory_every=1,
        ) as ckpt:
            ckpt.resume({"step": 0})
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            ckpt.save_to_memory(1, {"step": 1})
            ckpt.save(2, {"step": 2})
            ckpt.wait()
        seen.append(counts())
    from ftsdp.storage.saving import _save
    print(json.dumps({"seen": seen, "lanes": len(_save._lanes)}))
    """
)


def test_a_manager_per_root_leaves_nothing_behind_after_close(tmp_path) -> None:
    """Twelve managers on fresh roots in one process, each closed: descriptors and threads
    after the last are those after the first (each kept a gloo group, its sockets and threads
    before ``close()`` let go of them)."""
    result = _run(_MANY_ROOTS, str(tmp_path), "12")
    (fds0, threads0), (fds, threads) = result["seen"][1], result["seen"][-1]
    assert result["lanes"] == 0
    assert fds <= fds0 + 1 and threads <= threads0 + 1, result["seen"]


_EDGES = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import ftsdp
    from ftsdp import storage
    from ftsdp.storage.io import _collectives
    from ftsdp.storage.saving import _save

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    # a group made by a restore on nodes, with no save after it (no lane)
    storage.saving.restore_on_nodes(f"{sys.argv[1]}/nodes", node="n0")
    out["groups_after_restore"] = len(_collectives._own_groups)
    storage.saving.release(f"{sys.argv[1]}/nodes")
    out["groups_after_release"] = len(_collectives._own_groups)
    # a memory tier that saved, then was turned off (its root no longer private)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    mem = f"{sys.argv[1]}/mem"
    with ftsdp.CheckpointManager(f"{sys.argv[1]}/run", model, opt, memory_url=mem,
                                 memory_every=1) as ckpt:
        ckpt.resume({"step": 0})
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        ckpt.save_to_memory(1, {"step": 1})
        ckpt.wait()
        os.chmod(mem, 0o755)
        ckpt.save_to_memory(2, {"step": 2})
        ckpt.save(3, {"step": 3})
        ckpt.wait()
    out["memory_on"] = ckpt._memory.on
    out["lanes"] = len(_save._lanes)
    out["groups"] = len(_collectives._own_groups)
    print(json.dumps(out))
    """
)


def test_release_lets_go_of_a_group_without_a_lane_and_of_a_tier_turned_off(tmp_path) -> None:
    out = _run(_EDGES, str(tmp_path))
    assert out["groups_after_restore"] == 1 and out["groups_after_release"] == 0, out
    assert out["memory_on"] is False and out["lanes"] == 0 and out["groups"] == 0, out
