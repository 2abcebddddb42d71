"""Snapshots through the persister (``CheckpointManager(persister=True)``) on real gloo ranks.

One W=2 spawn runs a job that saves to the durable root every 2 steps and to the memory tier
every step, and checks:
- the durable steps the persister wrote equal, tensor by tensor, the same state saved by
  ``storage.save`` in the ranks' own processes (the reference), on a local root and on S3 (a
  real server, SeaweedFS);
- the slot directory, its files and the control socket are private to the user;
- a persister killed with SIGKILL is noticed at the next save, said so, restarted, and the job
  goes on committing; the durable root holds only committed steps;
- a persister that dies after every rank copied a step but before it committed it: the next
  manager's resume commits that step from shared memory and loads it (0 steps lost);
- after ``close()`` no persister is left and the slot files are gone.
"""

from __future__ import annotations

import os
import pathlib
import signal
import stat
import time

import pytest
import torch

from ftsdp import storage
from tests.distributed.test_checkpoint_manager import _build, _np, _train

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _memory(root: str) -> str:
    """A memory root deeper than a Unix socket's path may be (107 bytes)."""
    return os.path.join(root, *["a-user-folder-nested-deep"] * 4, "shm")


def _save(ck, step: int, trainer: dict) -> None:
    if ck.due(step):
        ck.save(step, trainer)
    else:
        ck.save_to_memory(step, trainer)


def _job(rank: int, world: int, root: str, s3_url: str, s3_options: dict) -> dict:
    import torch.distributed as dist

    from ftsdp.checkpoint import CheckpointManager

    logs: list[str] = []
    model, opt, sched = _build(0)

    def manager(**kw):
        return CheckpointManager(
            f"{root}/durable",
            model,
            opt,
            lr_scheduler=sched,
            every_steps=2,
            memory_url=_memory(root),
            memory_every=1,
            persister=True,
            log=logs.append,
            **kw,
        )

    ck = manager()
    trainer = {"step": 0, "cursor": 0, "tag": "persisted"}
    assert ck.resume(trainer) is None
    deferred = []
    for s in range(1, 5):
        _train(model, opt, sched, rank, world, trainer, 1)
        _save(ck, s, trainer)
        ck.in_flight()  # the loop's log line asks: it must not wait for the deferred copy
        deferred.append(ck._snap.copying is not None)
    ck.wait()
    dist.barrier()  # every rank has its answers before the persister dies
    folder = ck._snap.folder
    modes = {n: stat.S_IMODE(os.lstat(f"{folder}/{n}").st_mode) for n in os.listdir(folder)}
    modes["."] = stat.S_IMODE(os.lstat(folder).st_mode)
    first = ck._snap.proc.pid if rank == 0 else None
    if rank == 0:  # the persister dies between two saves
        os.kill(first, signal.SIGKILL)
        while _alive(first):
            time.sleep(0.01)
    dist.barrier()
    for s in range(5, 7):
        _train(model, opt, sched, rank, world, trainer, 1)
        _save(ck, s, trainer)
    ck.wait()
    at_6 = _np(model.state_dict())
    reference = CheckpointManager(f"{root}/ref", model, opt, lr_scheduler=sched, async_save=False)
    reference.save(6, trainer)
    second = ck._snap.proc.pid if rank == 0 else None

    # Step 7: every rank copies it, then its persister dies before committing it.
    if rank == 0:
        os.kill(second, signal.SIGSTOP)
    dist.barrier()
    _train(model, opt, sched, rank, world, trainer, 1)
    ck.save_to_memory(7, trainer)
    at_7, trainer_7 = _np(model.state_dict()), dict(trainer)
    dist.barrier()
    if rank == 0:
        os.kill(second, signal.SIGKILL)
        while _alive(second):
            time.sleep(0.01)
    dist.barrier()
    ck._snap.conn.close()  # the job died: nothing closes this manager
    if rank == 0:  # and the kernel released its lock on the slot folder
        os.close(ck._snap._lock_fd)

    model, opt, sched = _build(1)  # the restarted job
    ck = manager()
    trainer = {"step": 0, "cursor": 0, "tag": ""}
    info = ck.resume(trainer)
    resumed = {
        "step": info.step,
        "trainer": trainer == trainer_7,
        "from": ck.resumed_from,
        "model": _np(model.state_dict()),
    }
    third = ck._snap.proc.pid if rank == 0 else None
    ck.close()

    # The durable root on S3 (a real server), no memory tier: the persister uploads.
    s3 = CheckpointManager(
        s3_url, model, opt, lr_scheduler=sched, persister=True, storage_options=s3_options
    )
    s3.save(8, trainer, block=True)
    CheckpointManager(f"{root}/ref", model, opt, lr_scheduler=sched, async_save=False).save(
        8, trainer
    )
    fourth = s3._snap.proc.pid if rank == 0 else None
    s3_slots = s3._snap.folder  # without a memory tier: one folder per user and root
    s3.close()
    return {
        "logs": logs,
        "modes": modes,
        "pids": [first, second, third, fourth],
        "folder": folder,
        "s3_slots": s3_slots,
        "deferred": deferred,
        "at_6": at_6,
        "at_7": at_7,
        "resumed": resumed,
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory, s3_endpoint):
    from ftsdp.testing import run_ranks
    from tests.s3_fixture import new_bucket_url

    root = tmp_path_factory.mktemp("persister")
    s3_url = new_bucket_url(s3_endpoint)
    results = run_ranks(
        _job, 2, str(root), s3_url, s3_endpoint, timeout=240, start_method="forkserver"
    )
    return root, results, s3_url, s3_endpoint


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_the_persisted_steps_equal_the_same_state_saved_in_process(job) -> None:
    root, _, s3_url, s3_options = job
    assert storage.list_steps(f"{root}/durable") == [2, 4, 6]  # keep_last=3
    _same(storage.load_state_dict(f"{root}/durable", 6), storage.load_state_dict(f"{root}/ref", 6))
    on_s3 = storage.load_state_dict(s3_url, 8, storage_options=s3_options)
    _same(on_s3, storage.load_state_dict(f"{root}/ref", 8))


def test_a_save_returns_before_its_copy_and_in_flight_does_not_wait_for_it(job) -> None:
    _, results, *_ = job
    for r in results:
        assert r["deferred"][1:] == [True] * 3, r["deferred"]  # step 1: the persister starting


def test_the_slots_and_the_socket_are_private(job) -> None:
    _, results, *_ = job
    for r in results:
        modes = r["modes"]
        assert modes.pop(".") == 0o700
        assert "persister.sock" in modes and any(n.endswith(".o0") for n in modes), modes
        assert set(modes.values()) == {0o600}, modes


def test_a_killed_persister_is_restarted_and_the_job_goes_on(job) -> None:
    _, results, *_ = job
    died = [line for line in results[0]["logs"] if "THE SNAPSHOT PERSISTER DIED" in line]
    assert len(died) == 1, results[0]["logs"]
    first, second, *_ = results[0]["pids"]
    assert first != second


def test_a_step_copied_but_not_committed_is_resumed_from_shared_memory(job) -> None:
    root, results, *_ = job
    for r in results:
        resumed = r["resumed"]
        assert resumed["step"] == 7 and resumed["trainer"], resumed
        assert resumed["from"] == _memory(str(root))
        for k, v in r["at_7"].items():
            assert (resumed["model"][k] == v).all(), k
    assert any("were complete in shared memory" in line for line in results[0]["logs"])


def test_close_leaves_no_persister_and_no_slot(job) -> None:
    root, results, *_ = job
    assert not any(_alive(pid) for pid in results[0]["pids"])
    assert not os.path.exists(results[0]["folder"])
    slots = results[0]["s3_slots"]
    assert f"ftsdp-{os.geteuid()}-snapshots-" in slots and not os.path.exists(slots)
    assert storage.list_steps(_memory(str(root))) == []
