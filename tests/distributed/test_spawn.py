"""The rank spawner itself (``ftsdp.testing.run_ranks``): results in rank order, every failed
rank's traceback, a hang named and cut short, a ``"module:function"`` target from a parent that
never imports torch (spawned: a couple of seconds per process), forked ranks that see the caller's
environment."""

from __future__ import annotations

import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time

import pytest

from ftsdp.testing import run_ranks

REPO = pathlib.Path(__file__).resolve().parents[2]


def _report(rank: int, world: int, tag: str) -> dict:
    import torch
    import torch.distributed as dist

    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "SPAWN_TEST")
    return {
        "rank": rank,
        "world": world,
        "tag": tag,
        "sum": total.item(),
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in names},
    }


PARENT = """
import json, sys
from ftsdp.testing import run_ranks
out = run_ranks("tests.distributed.test_spawn:_report", 2, "x", threads=2, env={"SPAWN_TEST": "1"})
print(json.dumps({"results": out, "torch_in_parent": "torch" in sys.modules}))
"""


def test_a_named_target_runs_on_every_rank_and_the_parent_never_imports_torch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", PARENT], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch_in_parent"] is False
    assert [r["rank"] for r in out["results"]] == [0, 1]  # rank order
    for rank, r in enumerate(out["results"]):
        assert (r["world"], r["tag"], r["sum"], r["threads"]) == (2, "x", 3.0, 2)
        assert r["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "2",
            "SPAWN_TEST": "1",
        }


def _where(rank: int, world: int) -> tuple[str | None, str | None, str, int]:
    return os.environ.get("SPAWN_TEST"), os.environ.get("SPAWN_GONE"), os.getcwd(), os.getpid()


def test_forked_ranks_get_the_callers_environment_and_directory_at_each_call(
    tmp_path, monkeypatch
) -> None:
    """The fork server started with the first call's environment; a later call's ranks still see
    the caller's environment and working directory as they are then, and are new processes."""
    monkeypatch.setenv("SPAWN_TEST", "first")
    monkeypatch.setenv("SPAWN_GONE", "set")
    first = run_ranks(_where, 2, start_method="forkserver")
    assert [r[:3] for r in first] == [("first", "set", os.getcwd())] * 2
    monkeypatch.setenv("SPAWN_TEST", "later")
    monkeypatch.delenv("SPAWN_GONE")
    monkeypatch.chdir(tmp_path)
    later = run_ranks(_where, 2, start_method="forkserver", env={"SPAWN_GONE": "given"})
    assert [r[:3] for r in later] == [("later", "given", str(tmp_path))] * 2
    pids = {r[3] for r in first + later}
    assert len(pids) == 4 and os.getpid() not in pids
    with pytest.raises(ValueError, match="start_method='fork'"):
        run_ranks(_where, 2, start_method="fork")


def _both_fail(rank: int, world: int) -> None:
    if rank == 0:
        raise KeyError("first failure")
    raise ValueError("second failure")


def test_every_failed_rank_traceback_surfaces() -> None:
    with pytest.raises(RuntimeError) as info:
        run_ranks(_both_fail, 2, start_method="forkserver")
    message = str(info.value)
    assert "rank(s) [0, 1] raised" in message, message
    assert "--- rank 0 ---" in message and "KeyError: 'first failure'" in message, message
    assert "--- rank 1 ---" in message and "ValueError: second failure" in message, message
    assert "in _both_fail" in message, message  # the rank's own traceback
    assert "did not report" not in message, message


def _rank_1_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_a_hanging_rank_times_out_named_and_is_killed() -> None:
    t0 = time.monotonic()
    # 10 s: run alone, this call also starts the fork server (it imports torch)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not report within 10s") as info:
        run_ranks(_rank_1_hangs, 2, timeout=10, start_method="forkserver")
    assert time.monotonic() - t0 < 20
    assert "{1: None}" in str(info.value)  # still running when the wait ended
    assert multiprocessing.active_children() == []  # reaped
