"""Edges of deferred snapshots and of the memory tier, in one process: buffers that forward
changes in place, a memory tier left by another run, a memory root that is the checkpoint root,
the default memory root of two jobs.

References: the state cloned at the moment of the save, and a fresh optimizer."""

from __future__ import annotations

import logging
import os
import threading
import types
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager
from ftsdp.storage.saving import _save
from ftsdp.trainer._job import memory_root


def _model(width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_buffers_changed_in_place_by_forward_are_saved_as_they_were_at_the_save(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BatchNorm updates its running statistics in place in forward, which the optimizer's fence
    does not hold back: the next forward ran while the copy was held, and the step still holds
    the statistics of the moment of the save."""
    model, opt = _model()
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), model, opt)
    assert ckpt.resume({"step": 0}) is None
    _train(model, opt)
    release, real = threading.Event(), _save.copy_into

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30), "the test never released the snapshot copy"
        return real(*args, **kwargs)

    monkeypatch.setattr(_save, "copy_into", held)
    ckpt.save(1, {"step": 1})
    moment = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model(torch.randn(16, 4)).sum()  # the next step's forward, during the copy
    assert not torch.equal(model[1].running_mean, moment["1.running_mean"])
    release.set()
    loss.backward()
    opt.step()
    ckpt.close()
    saved = storage.load_state_dict(str(tmp_path / "ckpt"))
    for k, v in moment.items():
        assert torch.equal(saved[f"model.{k}"], v), k


def test_a_memory_tier_left_by_another_model_never_stops_a_resume(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A run killed without close() leaves its memory tier; a new run of a wider model on a new
    checkpoint root (the default memory root is derived from it, so a reused root name meets
    it) starts afresh, then resumes its own durable step; its first memory save replaces the
    stale step."""
    durable, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    model, opt = _model(8)
    old = CheckpointManager(str(tmp_path / "old"), model, opt, memory_url=shm)
    _train(model, opt)
    old.save_to_memory(5, {"step": 5})
    old.wait()  # killed: no close()

    model, opt = _model(16)
    fresh_model = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm)
    with caplog.at_level(logging.WARNING, logger="ftsdp.checkpoint._manager"):
        assert ckpt.resume({"step": 0}) is None  # was: StateMismatchError, on every restart
    assert "UNUSABLE" in caplog.text and "starting from scratch" in caplog.text
    assert not opt.state  # as fresh as it was: no state from the attempt to load
    for k, v in fresh_model.items():
        assert torch.equal(model.state_dict()[k], v), k

    _train(model, opt)
    ckpt.save(1, {"step": 1}, block=True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = _model(16)
    again = CheckpointManager(durable, model, opt, memory_url=shm)
    info = again.resume({"step": 0})  # memory step 5 (stale) first, then the durable step 1
    assert info is not None and info.step == 1 and again.resumed_from == durable
    for k, v in want.items():
        assert torch.equal(model.state_dict()[k], v), k
    _train(model, opt)
    again.save_to_memory(2, {"step": 2})
    again.wait()
    assert storage.list_steps(shm) == [2]  # the stale step 5 is gone


def test_a_memory_root_that_is_the_checkpoint_root_is_refused(tmp_path: Any) -> None:
    """close() clears the memory tier: at the checkpoint root it deleted every durable step."""
    model, opt = _model()
    root = tmp_path / "ckpt"
    for spelling in (str(root), f"file://{root}", f"{root}/", str(tmp_path / "x" / ".." / "ckpt")):
        with pytest.raises(ValueError, match="checkpoint root itself"):
            CheckpointManager(str(root), model, opt, memory_url=spelling)
    opt._optimizer_step_pre_hooks.clear()  # the refused managers' fences


def test_the_default_memory_root_is_one_per_checkpoint_root(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two jobs with ``--checkpoint-url ./ckpt`` in two folders have two checkpoint roots: they
    must not share a memory tier (the second resumed the first's steps)."""
    cfg = types.SimpleNamespace(memory_url=None)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    in_a = memory_root(cfg, "ckpt")  # type: ignore[arg-type]
    assert in_a == memory_root(cfg, str(tmp_path / "a" / "ckpt"))  # type: ignore[arg-type]
    monkeypatch.chdir(tmp_path / "b")
    assert memory_root(cfg, "ckpt") != in_a  # type: ignore[arg-type]
    assert memory_root(cfg, "s3://bucket/ckpt") == memory_root(cfg, "s3://bucket/ckpt")  # type: ignore[arg-type]


def test_the_memory_tier_of_a_deleted_checkpoint_root_is_not_resumed(tmp_path: Any) -> None:
    """``rm -rf ckpt`` and the same command again: the killed run's memory tier (same model,
    same root name, so the same default memory root) must not be resumed; a memory step saved
    before any durable commit still is (nothing tells it apart, and it is the common case)."""
    import shutil

    durable, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm)
    assert ckpt.resume({"step": 0}) is None
    _train(model, opt)
    ckpt.save_to_memory(1, {"step": 1})  # before any durable commit
    _train(model, opt)
    ckpt.save(2, {"step": 2}, block=True)
    for step in (3, 4):
        _train(model, opt)
        ckpt.save_to_memory(step, {"step": step})
    ckpt.wait()  # killed: no close()
    model, opt = _model()
    again = CheckpointManager(durable, model, opt, memory_url=shm)
    info = again.resume({"step": 0})
    assert info is not None and info.step == 4 and again.resumed_from == shm  # its own run

    shutil.rmtree(durable)  # started over: the memory tier is the deleted run's
    model, opt = _model()
    fresh = CheckpointManager(durable, model, opt, memory_url=shm)
    assert fresh.resume({"step": 0}) is None  # was: step 4 of the deleted run
    assert not opt.state

    shutil.rmtree(shm)
    model, opt = _model()
    first = CheckpointManager(durable, model, opt, memory_url=shm)
    first.resume({"step": 0})
    _train(model, opt)
    first.save_to_memory(1, {"step": 1})
    first.wait()
    model, opt = _model()
    info = CheckpointManager(durable, model, opt, memory_url=shm).resume({"step": 0})
    assert info is not None and info.step == 1  # before any durable commit: used


@pytest.fixture
def held_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold this process's deferred snapshot copies until the event is set (not a forked
    child's: its own saves run freely)."""
    import os

    release, real, parent = threading.Event(), _save.copy_into, os.getpid()

    def held(*args: Any, **kwargs: Any) -> Any:
        if os.getpid() == parent:
            assert release.wait(30), "the test never released the snapshot copy"
        return real(*args, **kwargs)

    monkeypatch.setattr(_save, "copy_into", held)
    return release


def test_a_child_forked_during_a_save_is_not_fenced_by_it(
    tmp_path: Any, held_copy: threading.Event
) -> None:
    """The parent's save in flight is no business of a forked child: the child's fence (an
    optimizer step there) passed only when its timeout ran out, since nothing in the child sets
    the parent's handle; and the child's own saves work."""
    import os
    import signal

    h = storage.save(
        {"x": torch.arange(8.0)}, str(tmp_path / "a"), 1, async_save=True, defer_copy=True
    )
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if nothing hangs
        signal.alarm(20)
        code = 1
        try:
            storage.saving.wait_snapshot(5)
            mine = storage.save(
                {"x": torch.ones(2)}, str(tmp_path / "b"), 2, async_save=True, defer_copy=True
            )
            mine.wait(10)
            code = 0
        finally:
            os._exit(code)
    held_copy.set()
    _, status = os.waitpid(pid, 0)
    h.wait(30)
    assert os.waitstatus_to_exitcode(status) == 0
    assert storage.list_steps(str(tmp_path / "a")) == [1]
    assert storage.list_steps(str(tmp_path / "b")) == [2]


def test_a_save_in_flight_at_exit_is_reported(
    tmp_path: Any,
    held_copy: threading.Event,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its threads are daemons: a save still in flight when the interpreter exits is lost, and
    exit says so instead of looking like a clean save (also when its copy outlasts the wait)."""
    monkeypatch.setattr(_save, "_EXIT_COPY_WAIT_S", 0.1)
    h = storage.save({"x": torch.arange(4.0)}, str(tmp_path), 3, async_save=True, defer_copy=True)
    with caplog.at_level(logging.WARNING, logger="ftsdp.storage.saving._save"):
        _save._warn_in_flight_at_exit()  # what atexit runs
    assert f"step 3 to {tmp_path}" in caplog.text and "not committed" in caplog.text
    held_copy.set()
    h.wait(30)
    caplog.clear()
    _save._warn_in_flight_at_exit()
    assert not caplog.text


def test_a_process_exits_with_a_save_stuck_in_flight(tmp_path: Any) -> None:
    """A deferred save that never finishes (its peer died: the exchange never returns) does not
    hold the interpreter's exit up: the thread that exchanges and commits is a daemon, exit waits
    only for the snapshot's copy (a daemon thread leaving a torch op during finalization aborts
    the process), and warns that the save is not committed."""
    import subprocess
    import sys

    script = (
        "import logging, sys, threading, torch\n"
        "from ftsdp import storage\n"
        "from ftsdp.storage.saving import _save\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "_save.exchange = lambda *a, **k: threading.Event().wait()  # a dead peer: for good\n"
        "storage.save({'x': torch.arange(4.0)}, sys.argv[1], 1, async_save=True, "
        "defer_copy=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "step 1" in done.stderr and "not committed" in done.stderr
    assert storage.list_steps(str(tmp_path / "ckpt")) == []


def test_ftsdp_train_clears_a_memory_tier_of_another_configuration(tmp_path: Any) -> None:
    """A job killed before its first durable save leaves its memory tier; the same checkpoint
    root with another seed resumed that step, then refused it as another configuration's, at
    every restart and naming an empty checkpoint root. ``build`` now clears such a tier first;
    the tier of the same configuration stays."""
    import dataclasses
    import json

    from ftsdp.trainer._config import TrainConfig
    from ftsdp.trainer._datasets import open_data
    from ftsdp.trainer._job import drop_another_runs_memory
    from ftsdp.trainer._models import plan_model

    url, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    cfg = TrainConfig(
        vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, global_batch=4,
        micro_batch=2, device="cpu", checkpoint_url=url, memory_every=1, memory_url=shm,
    )  # fmt: skip
    plan, data = plan_model(cfg), open_data(cfg)
    trainer = {  # what ftsdp.train saves (_loop.train)
        "step": 2,
        "config": json.dumps(dataclasses.asdict(cfg), sort_keys=True),
        "model": json.dumps(plan.record),
        "data": json.dumps(data.record),
    }
    os.mkdir(shm, 0o700)  # a memory root must be private (else it is never cleared)
    storage.save({"trainer": trainer, "w": torch.zeros(3)}, shm, 2)
    rm: Any = types.SimpleNamespace(rank=0, world_size=1, agree_any=lambda *flags: flags)
    drop_another_runs_memory(shm, cfg, plan.record, data.record, rm)
    assert storage.list_steps(shm) == [2]  # this run's own: kept
    drop_another_runs_memory(shm, dataclasses.replace(cfg, seed=1), plan.record, data.record, rm)
    assert storage.list_steps(shm) == []
