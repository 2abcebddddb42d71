"""CheckpointManager across its life: a save that failed and is tried again, a resume that is
refused, a ``with`` block left by an exception, saves after ``close()``. Each checks what is on
disk or in the live model against what the user was told."""

from __future__ import annotations

import contextlib
import pathlib
import time
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager, RootInUseError

pytestmark = pytest.mark.timeout(120)


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))


def _stepped(seed: int, groups: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after one step; ``groups``: the 2-D weights in a group of their own."""
    model = _net(seed)
    if groups:
        decay = [p for p in model.parameters() if p.ndim > 1]
        rest = [p for p in model.parameters() if p.ndim <= 1]
        params: list = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    else:
        params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("block", [False, True])
def test_a_step_whose_save_failed_is_saved_when_tried_again(
    tmp_path: pathlib.Path, block: bool
) -> None:
    """The async save of step 1 fails (its root cannot be made: a file is in the way); the
    user sees the error, clears the way and saves step 1 again: it is committed, with the
    values of the retry."""
    blocker = tmp_path / "disk"
    root = blocker / "ckpt"
    model, opt = _stepped(0)
    ckpt = CheckpointManager(str(root), model, opt)
    ckpt.resume({"step": 0})
    blocker.write_text("in the way")
    ckpt.save(1, {"step": 1})
    with pytest.raises(OSError):
        ckpt.wait()
    blocker.unlink()
    blocker.mkdir()
    want = _values(model)
    ckpt.save(1, {"step": 1}, block=block)
    ckpt.close()
    assert storage.list_steps(str(root)) == [1]
    loaded = storage.load_state_dict(str(root))
    for name, value in want.items():
        assert torch.equal(loaded[f"model.{name}"], value), name


def test_a_resume_refused_for_other_param_groups_changes_nothing(tmp_path: pathlib.Path) -> None:
    """The same parameter names and shapes, split into other param groups: refused before
    anything is loaded into the model, the optimizer or the trainer values."""
    model, opt = _stepped(0)
    with CheckpointManager(str(tmp_path), model, opt, async_save=False) as ckpt:
        ckpt.resume({"step": 0})
        ckpt.save(1, {"step": 1})
    other, _ = _stepped(1)
    decay = [p for p in other.parameters() if p.ndim > 1]
    rest = [p for p in other.parameters() if p.ndim <= 1]
    opt2 = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    before, trainer = _values(other), {"step": 0}
    with pytest.raises(storage.StateMismatchError, match="param groups hold other parameters"):
        CheckpointManager(str(tmp_path), other, opt2).resume(trainer)
    after = _values(other)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert trainer == {"step": 0}
    assert not opt2.state  # no state created, none loaded


@pytest.mark.parametrize("state", ["none", "some"])
def test_a_refused_resume_leaves_the_optimizer_as_it_was(
    tmp_path: pathlib.Path, state: str
) -> None:
    """A checkpoint of a narrower model is refused; the optimizer keeps exactly the state it
    had (none, or the first layer's after a step that reached only it), so a script that then
    trains from scratch takes the step it would have taken."""
    model, opt = _stepped(0)
    with CheckpointManager(str(tmp_path), model, opt, async_save=False) as ckpt:
        ckpt.resume({"step": 0})
        ckpt.save(1, {"step": 1})
    wider = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 2))
    opt2 = torch.optim.AdamW(wider.parameters(), lr=1e-2)
    if state == "some":
        wider[0](torch.randn(4, 8)).sum().backward()
        opt2.step()
        opt2.zero_grad(set_to_none=True)
    before = {id(p): {k: v.clone() for k, v in e.items()} for p, e in opt2.state.items()}
    with pytest.raises(storage.StateMismatchError):
        CheckpointManager(str(tmp_path), wider, opt2).resume({"step": 0})
    assert {id(p) for p in opt2.state} == set(before)
    for p, entry in opt2.state.items():
        assert all(torch.equal(v, before[id(p)][k]) for k, v in entry.items())


def test_a_failed_save_after_a_fallback_still_discards_the_newer_steps(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume fell back past a bad step 20 to 10; the first save after it (15) is to discard
    20 and fails before its commit: its retry still does (it was refused for the newer 20)."""
    from ftsdp.storage.saving import _save

    model, opt = _stepped(0)
    with CheckpointManager(str(tmp_path), model, opt, async_save=False) as ckpt:
        ckpt.resume({"step": 0})
        ckpt.save(10, {"step": 10})
        ckpt.save(20, {"step": 20})
    obj = next((tmp_path / "step-20").glob("*.safetensors"))
    obj.write_bytes(obj.read_bytes()[:10])  # step 20 unusable
    resumed, opt2 = _stepped(1)
    lines: list[str] = []
    ckpt = CheckpointManager(str(tmp_path), resumed, opt2, log=lines.append)
    assert ckpt.resume({"step": 0}).step == 10
    real = _save.finish

    def fails(*args: object, **kwargs: object) -> None:
        raise OSError("the object store said no")

    monkeypatch.setattr(_save, "finish", fails)
    ckpt.save(15, {"step": 15})
    with pytest.raises(OSError, match="said no"):
        ckpt.wait()
    monkeypatch.setattr(_save, "finish", real)
    ckpt.save(15, {"step": 15}, block=True)
    ckpt.close()
    assert storage.list_steps(str(tmp_path)) == [10, 15]


def test_leaving_a_with_block_on_an_exception_keeps_the_memory_tier(
    tmp_path: pathlib.Path,
) -> None:
    """The documented contract: a failed run leaves the memory tier for its restart, which
    resumes from its newest step; only close() at a normal end clears it."""
    durable, memory = tmp_path / "ckpt", tmp_path / "mem"
    model, opt = _stepped(0)
    with (
        pytest.raises(RuntimeError, match="the training loop failed"),
        CheckpointManager(
            str(durable), model, opt, every_steps=100, memory_url=str(memory), memory_every=1
        ) as ckpt,
    ):
        ckpt.resume({"step": 0})
        for step in (1, 2, 3):
            ckpt.save_to_memory(step, {"step": step})
        ckpt.wait()
        raise RuntimeError("the training loop failed")
    assert storage.list_steps(str(memory))[-1] == 3
    want = _values(model)
    restarted, opt2 = _stepped(1)
    trainer = {"step": 0}
    with CheckpointManager(
        str(durable), restarted, opt2, every_steps=100, memory_url=str(memory), memory_every=1
    ) as ckpt2:
        info = ckpt2.resume(trainer)
        assert info is not None and info.step == 3 and trainer == {"step": 3}
        assert ckpt2.resumed_from == str(memory)
        got = _values(restarted)
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert storage.list_steps(str(memory)) == []  # a normal end clears it


def test_a_save_after_close_holds_the_values_at_the_save(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() takes the fence off the optimizer, so a later save cannot defer its copy to the
    next step: it copies before it returns (the copy slowed down here, so that a deferred one
    would still be running), and an optimizer step right after it changes nothing saved."""
    import time

    from ftsdp.storage.saving import _save

    real = _save.copy_into

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(_save, "copy_into", slow)
    model, opt = _stepped(0)
    ckpt = CheckpointManager(str(tmp_path), model, opt)
    ckpt.resume({"step": 0})
    ckpt.save(1, {"step": 1})
    ckpt.close()
    for step in (2, 3, 4):
        model(torch.randn(4, 8)).sum().backward()
        want = _values(model)
        ckpt.save(step, {"step": step})
        opt.step()  # at once: no fence waits for a copy now
        opt.zero_grad(set_to_none=True)
        ckpt.wait()
        saved = storage.load_state_dict(str(tmp_path), step)
        assert all(torch.equal(saved[f"model.{k}"], v) for k, v in want.items()), step
    ckpt.close()  # idempotent
    assert storage.list_steps(str(tmp_path)) == [2, 3, 4]  # keep_last=3


@pytest.mark.parametrize("step", [True, 2.5, -1, "3"])
def test_a_step_that_is_not_a_non_negative_int_is_refused_by_both_tiers(
    tmp_path: pathlib.Path, step: object
) -> None:
    """``save`` and ``save_to_memory`` (in-process and through the persister) refuse a bool, a
    float, a negative int or a str as the step, and write nothing."""
    for persister in (False, True):
        model, opt = _stepped(0)
        durable, memory = tmp_path / f"ckpt{persister}", tmp_path / f"mem{persister}"
        with CheckpointManager(
            str(durable), model, opt, memory_url=str(memory), memory_every=1, persister=persister
        ) as ckpt:
            ckpt.resume({"step": 0})
            for call in (ckpt.save, ckpt.save_to_memory):
                with pytest.raises(ValueError, match="must be a non-negative int"):
                    call(step, {"step": 0})  # type: ignore[operator]
            ckpt.wait()
        assert storage.list_steps(str(durable)) == []
        assert storage.list_steps(str(memory)) == []


def test_a_tensor_learning_rate_and_its_scheduler_resume(tmp_path: pathlib.Path) -> None:
    """torch's recipe for a compiled optimizer with a scheduler: ``lr=torch.tensor(...)``.
    The scheduler's state then holds tensors (``base_lrs``, ``_last_lr``); it is saved (the
    save failed before training, in ``resume``) and comes back as tensors, and the resumed
    run's learning rates follow the uninterrupted one's."""

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    model, opt, sched = build(0)
    with CheckpointManager(str(tmp_path), model, opt, lr_scheduler=sched) as ckpt:
        ckpt.resume({"step": 0})
        for _ in range(3):
            step(model, opt, sched)
        ckpt.save(3, {"step": 3})
    lr_at_save = float(opt.param_groups[0]["lr"])
    step(model, opt, sched)
    again, again_opt, again_sched = build(1)
    with CheckpointManager(str(tmp_path), again, again_opt, lr_scheduler=again_sched) as ckpt:
        assert ckpt.resume({"step": 0}) is not None
    assert all(isinstance(x, torch.Tensor) for x in again_sched.state_dict()["base_lrs"])
    assert float(again_opt.param_groups[0]["lr"]) == lr_at_save
    step(again, again_opt, again_sched)
    assert float(again_opt.param_groups[0]["lr"]) == float(opt.param_groups[0]["lr"])
    assert again_sched.get_last_lr() == sched.get_last_lr()
    for a, b in zip(again.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_newest_memory_step_known_to_the_persister_never_goes_back(
    tmp_path: pathlib.Path, shm_path: pathlib.Path
) -> None:
    """The persister may answer a memory snapshot before the durable save of the step before
    it: after ``wait()``, ``newest_committed()`` names the newest step the memory tier holds
    (it named the older one in most such waits)."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    memory = str(shm_path / "tier")
    with CheckpointManager(
        str(tmp_path), model, opt, persister=True, memory_url=memory, memory_every=1, every_steps=2
    ) as ckpt:
        ckpt.resume({})
        ckpt.save(0, {})  # waits for the persister to listen (memory snapshots do not)
        for step in range(1, 13):
            model(torch.randn(2, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            if ckpt.due(step):
                ckpt.save(step, {})
            ckpt.save_to_memory(step, {})
            if step % 2:  # a memory snapshot right after a durable save
                ckpt.wait()
                assert ckpt.newest_committed()["memory"] == storage.list_steps(memory)[-1]


@pytest.mark.parametrize("ahead", [True, False], ids=["newer-steps", "same-step"])
def test_a_second_job_on_the_same_root_is_named_as_such(
    tmp_path: pathlib.Path, ahead: bool
) -> None:
    """Two jobs started on one root: the one behind fails with ``RootInUseError`` naming the
    other writer's steps (not a bare "step 5 is already committed"); what the other committed
    stays, and the first job's own earlier steps are not counted as another writer's."""
    model, opt = _stepped(0)
    other_model, other_opt = _stepped(1)
    first = CheckpointManager(str(tmp_path), model, opt, async_save=False)
    second = CheckpointManager(str(tmp_path), other_model, other_opt, async_save=False)
    first.resume({"step": 0})
    second.resume({"step": 0})
    first.save(2, {"step": 2})  # its own: never "another writer"
    for step in (4, 6) if ahead else (4,):
        second.save(step, {"step": step})
    with pytest.raises(RootInUseError, match=r"another job is saving to .*step\(s\) \[4") as e:
        first.save(4, {"step": 4})
    assert "[2" not in str(e.value) and "found no committed step" in str(e.value)
    assert storage.list_steps(str(tmp_path)) == ([2, 4, 6] if ahead else [2, 4])
    loaded = storage.load_state_dict(str(tmp_path), step=4)
    for name, value in other_model.state_dict().items():
        assert torch.equal(loaded[f"model.{name}"], value), name


def test_a_save_behind_newer_steps_without_another_job_keeps_its_own_error(
    tmp_path: pathlib.Path,
) -> None:
    """A manager that never resumed does not know the root: steps newer than its save are
    refused with storage's own error, not blamed on another job."""
    model, opt = _stepped(0)
    with CheckpointManager(str(tmp_path), model, opt, async_save=False) as ckpt:
        ckpt.save(6, {"step": 6})
    fresh = CheckpointManager(str(tmp_path), *_stepped(1), async_save=False)
    with pytest.raises(storage.CheckpointError, match="newer than it exist") as e:
        fresh.save(4, {"step": 4})
    assert not isinstance(e.value, RootInUseError)


def test_a_step_this_job_committed_despite_an_error_is_not_another_writers(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save of step 1 commits, then its listing of the root fails: the save raises, and
    the step is committed without the manager knowing. Trying step 1 again is refused as
    committed, and a later unrelated failure is itself: neither is "another job"."""
    from ftsdp.storage.saving import _commit

    real = _commit.scan_root
    failures = []

    def scan(store: Any, *args: Any, **kwargs: Any) -> Any:
        if store.exists("step-1/manifest.json") and not failures:
            failures.append(1)
            raise OSError(5, "injected: listing the root after the commit failed")
        return real(store, *args, **kwargs)

    model, opt = _stepped(0)
    ckpt = CheckpointManager(str(tmp_path), model, opt, async_save=False)
    ckpt.resume({"step": 0})
    monkeypatch.setattr(_commit, "scan_root", scan)
    with pytest.raises(OSError, match="injected"):
        ckpt.save(1, {"step": 1})
    assert storage.list_steps(str(tmp_path)) == [1]
    with pytest.raises(FileExistsError, match="step 1 is already committed") as e:
        ckpt.save(1, {"step": 1})
    assert not isinstance(e.value, RootInUseError)

    def refuse() -> None:
        raise storage.CheckpointError("injected: an unrelated refusal")

    monkeypatch.setattr(_commit, "_GUARDS", [refuse])
    with pytest.raises(storage.CheckpointError, match="unrelated") as e:
        ckpt.save(2, {"step": 2})
    assert not isinstance(e.value, RootInUseError)


def test_a_second_job_with_a_persister_on_the_same_root_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    """Two jobs on one root and one machine with ``persister=True`` shared the slot folder and
    its socket (one per user and root): each took over the other's persister, and they failed
    with unrelated errors or hung. The second now gets ``RootInUseError`` at its resume; the
    first saves on, and once it closed, a later job uses the root."""
    model, opt = _stepped(0)
    first = CheckpointManager(str(tmp_path), model, opt, persister=True)
    first.resume({"step": 0})
    first.save(1, {"step": 1})
    second = CheckpointManager(str(tmp_path), *_stepped(1), persister=True)
    with pytest.raises(RootInUseError, match="from this machine: its snapshot persister holds"):
        second.resume({"step": 0})
    first.save(2, {"step": 2})
    first.close()
    assert storage.list_steps(str(tmp_path)) == [1, 2]
    want = _values(model)
    loaded = storage.load_state_dict(str(tmp_path), 2)
    assert all(torch.equal(loaded[f"model.{k}"], v) for k, v in want.items())
    third = CheckpointManager(str(tmp_path), *_stepped(2), persister=True)
    assert third.resume({"step": 0}).step == 2
    third.save(3, {"step": 3})
    third.close()
    assert storage.list_steps(str(tmp_path)) == [1, 2, 3]


def test_two_jobs_with_persisters_of_their_own_on_one_root(
    tmp_path: pathlib.Path, shm_path: pathlib.Path
) -> None:
    """Two jobs on one durable root, each with its persister and memory tier: the one behind
    failed with a CheckpointError and a traceback (its persister's refusal, raised as it came);
    it is ``RootInUseError`` now, as without a persister."""
    root = str(tmp_path / "ckpt")

    def job(seed: int, memory: str) -> CheckpointManager:
        model, opt = _stepped(seed)
        m = CheckpointManager(
            root, model, opt, persister=True, memory_url=str(shm_path / memory), memory_every=1
        )
        m.resume({"step": 0})
        return m

    first, second = job(0, "a"), job(1, "b")
    try:
        for step in (2, 4):
            second.save(step, {"step": step}, block=True)
        first.save(2, {"step": 2})
        while first.in_flight():  # until its persister's refusal has come back
            time.sleep(0.02)
        with pytest.raises(RootInUseError, match=r"another job .* step\(s\) \[2, 4\]"):
            first.save(4, {"step": 4})  # the refusal is raised by the next save
    finally:
        second.close()
        with contextlib.suppress(Exception):
            first.close()
    assert storage.list_steps(root) == [2, 4]


def test_a_persister_that_cannot_hold_the_state_hands_the_saves_back(
    tmp_path: pathlib.Path, shm_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The persister refuses the state when its slots cannot be made (a memory tier already
    full: ENOSPC): the job died at its first save, with no durable step ever written, where
    without a persister it trains on. Now the persister stops, one line says so, and every
    save from then on runs in this process: the durable steps and the memory tier's are
    committed and hold the values of their steps."""
    from ftsdp.checkpoint import _snapshots

    def refused(self: Any, rows: Any, leaves: Any) -> None:
        raise storage.CheckpointError(
            "the snapshot persister refused the state: OSError: [Errno 28] No space left on device"
        )

    monkeypatch.setattr(_snapshots.Snapshots, "_hello", refused)
    lines: list[str] = []
    model, opt = _stepped(0)
    memory = str(shm_path / "tier")
    ckpt = CheckpointManager(
        str(tmp_path), model, opt, persister=True, memory_url=memory, memory_every=1,
        log=lines.append,
    )  # fmt: skip
    ckpt.resume({"step": 0})
    ckpt.save(1, {"step": 1}, block=True)
    want = _values(model)
    ckpt.save_to_memory(2, {"step": 2})
    ckpt.wait()
    assert ckpt._snap is not None and ckpt._snap.on is False
    assert storage.list_steps(str(tmp_path)) == [1] and storage.list_steps(memory) == [2]
    for url, step in ((str(tmp_path), 1), (memory, 2)):
        loaded = storage.load_state_dict(url, step)
        assert all(torch.equal(loaded[f"model.{k}"], v) for k, v in want.items())
    ckpt.close()
    (told,) = [line for line in lines if "cannot hold this state" in line]
    assert told.endswith("saves run in each rank's process from now on")
