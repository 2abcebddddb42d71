"""The memory tier on a shared machine (docs/format.md, "On a shared machine"): its root is this
user's private directory, never a link, checked again before each use; one that fails is neither
loaded nor cleared. In one process.

References: the steps saved to the durable root before (still all there), the model's tensors
at the save, the uid and mode the OS reports."""

from __future__ import annotations

import logging
import os
import stat
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager
from ftsdp.trainer._job import drop_another_runs_memory, memory_root

LOGGER = "ftsdp.checkpoint._manager"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)  # the common default: without the fix, files came out 0644
    yield
    os.umask(old)


def _durable_steps(durable: str, steps: tuple[int, ...]) -> None:
    model, opt = _model()
    with CheckpointManager(durable, model, opt) as ckpt:
        for step in steps:
            _train(model, opt)
            ckpt.save(step, {"step": step}, block=True)
    assert storage.list_steps(durable) == list(steps)


def test_a_link_planted_at_the_memory_root_is_refused_and_close_deletes_nothing(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A link to the durable root planted at the memory root: close() deleted durable steps 2, 4
    and 6. Now the tier turns off naming the root, and the durable steps all stay."""
    durable, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    _durable_steps(durable, (2, 4, 6))
    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm, memory_every=1)
    os.symlink(durable, shm)  # after the manager was built: its path check saw nothing
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = ckpt.resume({"step": 0})
    due = ckpt.memory_due(7)
    ckpt.close()
    assert storage.list_steps(durable) == [2, 4, 6]
    assert os.path.islink(shm)  # not ours to remove either
    assert info is not None and info.step == 6 and ckpt.resumed_from == durable
    assert f"the memory tier {shm} is off: it is a symbolic link" in caplog.text
    assert not due


def test_a_root_swapped_for_a_link_between_saves_turns_the_tier_off(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The root passed its checks when first used, then a link to the durable root took its
    place: the next memory save is refused (the tier turns off) and close() clears nothing."""
    durable, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    _durable_steps(durable, (2, 4))
    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm, memory_every=1)
    assert ckpt.resume({"step": 0}) is not None
    _train(model, opt)
    ckpt.save_to_memory(5, {"step": 5})
    ckpt.wait()
    assert storage.list_steps(shm) == [5]
    os.rename(shm, str(tmp_path / "moved"))
    os.symlink(durable, shm)
    _train(model, opt)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ckpt.save_to_memory(6, {"step": 6})
        ckpt.wait()
    assert f"the memory tier {shm} is off" in caplog.text
    assert "something else was put at its path" in caplog.text
    assert not ckpt.memory_due(7)
    ckpt.close()
    assert storage.list_steps(durable) == [2, 4]  # nothing saved there, nothing cleared
    assert storage.list_steps(str(tmp_path / "moved")) == [5]


@pytest.mark.parametrize("how", ["another uid", "group and other bits"])
def test_a_root_that_is_not_this_users_own_is_never_loaded_nor_cleared(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Another user's tier at the memory root, newer than any durable step, was resumed (its
    weights poisoned the run). Now the resume loads the durable step, and close() leaves the
    other root's step alone."""
    durable, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    _durable_steps(durable, (2,))
    model, opt = _model()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.fill_(666.0)
    planted = CheckpointManager(str(tmp_path / "other"), model, opt, memory_url=shm)
    planted.save_to_memory(9, {"step": 9})
    planted.wait()  # killed: no close()
    assert storage.list_steps(shm) == [9]
    if how == "another uid":  # tests run as root: the root is made to be someone else's
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 4242)
        why = f"it is owned by uid {real}, not by this process's uid {real + 4242}"
    else:
        os.chmod(shm, 0o755)
        why = "its mode 0755 lets other users in"

    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm, memory_every=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        info = ckpt.resume({"step": 0})
    assert info is not None and info.step == 2 and ckpt.resumed_from == durable
    assert f"the memory tier {shm} is off: {why}" in caplog.text
    saved = storage.load_state_dict(durable, 2)
    for k in want:
        assert torch.equal(model.state_dict()[k], saved[f"model.{k}"]), k
    assert not torch.any(model.weight == 666.0)
    ckpt.close()
    assert storage.list_steps(shm) == [9]


def test_ftsdp_train_leaves_a_memory_root_open_to_others_alone(tmp_path: Any) -> None:
    """``build`` clears a memory tier of another configuration; not one whose root lets other
    users in (whose files could be anyone's, or a link's target)."""
    import dataclasses
    import json

    from ftsdp.trainer._config import TrainConfig
    from ftsdp.trainer._datasets import open_data
    from ftsdp.trainer._models import plan_model

    shm = str(tmp_path / "shm")
    cfg = TrainConfig(
        vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, global_batch=4,
        micro_batch=2, device="cpu", checkpoint_url=str(tmp_path / "ckpt"), memory_every=1,
        memory_url=shm,
    )  # fmt: skip
    plan, data = plan_model(cfg), open_data(cfg)
    trainer = {
        "step": 1,
        "config": json.dumps(dataclasses.asdict(cfg), sort_keys=True),
        "model": json.dumps(plan.record),
        "data": json.dumps(data.record),
    }
    storage.save({"trainer": trainer, "w": torch.zeros(3)}, shm, 1)
    os.chmod(shm, 0o755)
    rm: Any = types.SimpleNamespace(rank=0, world_size=1, agree_any=lambda *flags: flags)
    other = dataclasses.replace(cfg, seed=1)  # another configuration's tier: cleared when private
    drop_another_runs_memory(shm, other, plan.record, data.record, rm)
    assert storage.list_steps(shm) == [1]
    os.chmod(shm, 0o700)
    drop_another_runs_memory(shm, other, plan.record, data.record, rm)
    assert storage.list_steps(shm) == []


def test_the_memory_root_is_0700_and_its_files_0600(tmp_path: Any, umask_022: None) -> None:
    """Files came out 0644 in a 0755 folder under the common umask: any user read the weights
    and the configuration. The durable root keeps the umask's modes (a team's shared disk may
    grant its group access)."""
    durable, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm, memory_every=1)
    ckpt.resume({"step": 0})
    _train(model, opt)
    ckpt.save(1, {"step": 1}, block=True)
    _train(model, opt)
    ckpt.save_to_memory(2, {"step": 2})
    ckpt.wait()
    root = os.stat(shm)
    assert root.st_uid == os.geteuid() and stat.S_IMODE(root.st_mode) == 0o700
    files = 0
    for folder, dirs, names in os.walk(shm):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(folder, d)).st_mode) == 0o700, d
        for n in names:
            assert stat.S_IMODE(os.stat(os.path.join(folder, n)).st_mode) == 0o600, n
            files += 1
    assert files >= 2  # the step's shard and its manifest at least
    durable_modes = {
        stat.S_IMODE(os.stat(os.path.join(f, n)).st_mode)
        for f, _, ns in os.walk(durable)
        for n in ns
    }
    assert durable_modes == {0o644}
    ckpt.close()


def test_the_default_memory_root_names_the_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two users training from the same checkpoint root get two memory roots, each named with
    its uid (a root of another user is refused, not shared)."""
    cfg: Any = types.SimpleNamespace(memory_url=None)
    mine = memory_root(cfg, "/data/ckpt")
    assert os.path.basename(mine).startswith(f"ftsdp-{os.geteuid()}-")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    theirs = memory_root(cfg, "/data/ckpt")
    assert os.path.basename(theirs).startswith("ftsdp-4242-") and theirs != mine


def test_a_memory_tier_that_keeps_failing_says_so_once_then_counts(
    tmp_path: Any, shm_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full memory tier fails at every step: it logged one warning per step and rank (161
    lines in a 120-step run). Now the first failure whole, then the count at 10, 100, ...; and
    a line when saves work again."""
    from ftsdp.checkpoint import _tiers

    durable, shm = str(tmp_path / "ckpt"), str(shm_path / "tier")
    real, full = _tiers.storage.save, {"on": True}

    def save(state: Any, url: str, step: int, **kwargs: Any) -> Any:
        if url == shm and full["on"]:
            raise OSError(28, "No space left on device", f"{shm}/step-{step}")
        return real(state, url, step, **kwargs)

    monkeypatch.setattr(_tiers.storage, "save", save)
    lines: list[str] = []
    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=shm, memory_every=1, log=lines.append)
    ckpt.resume({"step": 0})
    for step in range(1, 13):
        ckpt.save_to_memory(step, {"step": step})
        ckpt.wait()
    full["on"] = False
    ckpt.save_to_memory(13, {"step": 13})
    ckpt.wait()
    ckpt.close()
    told = [line for line in lines if "memory" in line and ("fail" in line or "again" in line)]
    assert len(told) == 3, told
    assert "failed: [Errno 28] No space left on device" in told[0]
    assert "still fail: 10 in a row" in told[1]
    assert "work again (after 12 failed in a row)" in told[2]
