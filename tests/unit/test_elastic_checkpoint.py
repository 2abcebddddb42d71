"""CheckpointManager in one process: round trip of model, optimizer, scheduler, RNG and trainer
values; fallback from a corrupt newest step; what must not fall back; async errors surface."""

from __future__ import annotations

import pathlib
import random
import time

import numpy as np
import pytest
import torch

import ftsdp
from ftsdp import storage
from ftsdp.trainer._checkpoint import CheckpointManager
from ftsdp.trainer.model import GPT, Block, GPTConfig, param_groups

pytestmark = pytest.mark.timeout(120)
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _build(seed: int, config: GPTConfig = CONFIG):
    torch.manual_seed(seed)
    model = ftsdp.FSDP(GPT(config), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int, seed: int = 0) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=g)
        _, loss = model(x, x.roll(1, 1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses


def _manager(url, model, opt, sched, **kw) -> CheckpointManager:
    return CheckpointManager(str(url), model, opt, lr_scheduler=sched, **kw)


def _assert_same(a, b) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    sda, sdb = ma.state_dict(), mb.state_dict()
    for k in sda:
        assert torch.equal(sda[k], sdb[k]), k
    for sta, stb in zip(oa.state.values(), ob.state.values(), strict=True):
        assert sta.keys() == stb.keys()
        for k in sta:
            assert torch.equal(sta[k], stb[k]), k
    assert sa.state_dict() == sb.state_dict()
    assert [g["lr"] for g in oa.param_groups] == [g["lr"] for g in ob.param_groups]


def test_resume_restores_everything_bitwise_and_training_continues_identically(tmp_path):
    url = tmp_path / "ck"
    a = _build(0)
    _train(*a, steps=3)
    ckpt = _manager(url, *a, every_steps=3)
    assert ckpt.due(3) and not ckpt.due(4)
    trainer = {"step": 3, "cursor": 36, "note": "hello"}
    blocking = ckpt.save(3, trainer)  # async by default
    assert blocking >= 0 and ckpt.last_saved_step == 3
    assert ckpt.save(3, trainer) == 0.0  # the same step again: a no-op
    ckpt.close()
    after_save = (torch.rand(3), np.random.rand(), random.random())
    expected = _train(*a, steps=2, seed=1)

    b = _build(123)  # another init: everything must come from the checkpoint
    template = {"step": 0, "cursor": 0, "note": ""}
    info = _manager(url, *b).resume(template)
    assert info is not None and info.step == 3 and info.saved_world_size == 1
    assert info.rng_restored and info.skipped == []
    assert template == trainer
    # RNG streams continue exactly where the save left them.
    assert torch.equal(torch.rand(3), after_save[0])
    assert np.random.rand() == after_save[1] and random.random() == after_save[2]
    assert _train(*b, steps=2, seed=1) == expected
    _assert_same(a, b)


def test_fresh_start_returns_none(tmp_path):
    m = _build(0)
    assert _manager(tmp_path / "nothing", *m).resume({"step": 0}) is None


def _corrupt_newest(root: pathlib.Path, step: int) -> None:
    obj = max((root / f"step-{step}").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(obj.read_bytes())
    data[-5] ^= 0xFF  # inside the payload: the checksum catches it
    obj.write_bytes(bytes(data))


def test_a_corrupt_newest_step_falls_back_loudly(tmp_path):
    url = tmp_path / "ck"
    a = _build(0)
    ckpt = _manager(url, *a, async_save=False)
    _train(*a, steps=1)
    ckpt.save(1, {"step": 1})
    state_at_1 = {k: v.clone() for k, v in a[0].state_dict().items()}
    _train(*a, steps=1)
    ckpt.save(2, {"step": 2})
    _corrupt_newest(url, 2)

    lines: list[str] = []
    b = _build(5)
    template = {"step": 0}
    info = _manager(url, *b, log=lines.append).resume(template)
    assert info.step == 1 and template == {"step": 1}
    assert info.skipped and info.skipped[0][0] == 2 and "Corrupt" in info.skipped[0][1]
    assert len(lines) == 1
    assert "CHECKPOINT STEP 2" in lines[0] and "UNUSABLE" in lines[0]
    assert "falling back to step 1" in lines[0]
    sd = b[0].state_dict()
    assert all(torch.equal(sd[k], state_at_1[k]) for k in sd)

    _corrupt_newest(url, 1)
    with pytest.raises(storage.CheckpointError, match=r"committed steps \[1, 2\] all failed"):
        _manager(url, *_build(5), log=lines.append).resume({"step": 0})


def test_a_different_model_is_an_error_not_a_fallback(tmp_path):
    url = tmp_path / "ck"
    a = _build(0)
    _train(*a, steps=1)
    _manager(url, *a, async_save=False).save(1, {"step": 1})
    lines: list[str] = []
    wider = _build(0, GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=64))
    with pytest.raises(storage.StateMismatchError, match="mismatched"):
        _manager(url, *wider, log=lines.append).resume({"step": 0})
    assert lines == []  # no fallback was attempted
    with pytest.raises(storage.StateMismatchError, match="missing"):
        _manager(url, *_build(0)).resume({"step": 0, "extra_key": 1})


def test_async_save_errors_surface(tmp_path):
    a = _build(0)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ckpt = _manager(blocker / "ck", *a)
    with pytest.raises(Exception):  # noqa: B017 - the backend's error, whichever it is
        ckpt.save(1, {"step": 1})
        ckpt.close()
    ckpt.close()  # close after a failure works


def test_an_async_save_that_failed_before_save_returned_still_surfaces(tmp_path, monkeypatch):
    """The race of test_async_save_errors_surface made certain: the background save has
    already failed when ``save`` looks at its handle."""
    real = storage.save

    def save_and_let_it_finish(*args, **kwargs):
        handle = real(*args, **kwargs)
        while not handle.done():
            time.sleep(0.01)
        return handle

    monkeypatch.setattr(storage, "save", save_and_let_it_finish)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    ckpt = _manager(blocker / "ck", *_build(0))
    assert ckpt.save(1, {"step": 1}) >= 0  # async: the error is not raised here
    with pytest.raises(Exception):  # noqa: B017 - the backend's error, whichever it is
        ckpt.close()
    ckpt.close()  # raised once; closing again is fine


def test_time_based_saves_and_bad_arguments(tmp_path):
    m = _build(0)
    ckpt = _manager(tmp_path / "ck", *m, every_seconds=0.05)
    assert not ckpt.due(1)
    import time

    time.sleep(0.06)
    assert ckpt.due(1)
    ckpt.save(1, {"step": 1}, block=True)
    assert not ckpt.due(2) and not ckpt.in_flight()
    with pytest.raises(ValueError, match="every_steps=0"):
        _manager(tmp_path, *m, every_steps=0)
    with pytest.raises(ValueError, match="every_seconds=-1"):
        _manager(tmp_path, *m, every_seconds=-1)
    with pytest.raises(ValueError, match="url=''"):
        CheckpointManager("", m[0], m[1])
    with pytest.raises(ValueError, match="sharded_state_dict"):
        CheckpointManager(str(tmp_path), torch.nn.Linear(2, 2), m[1])
    sgd = torch.optim.SGD(m[0].parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="got SGD"):
        _manager(tmp_path / "ck", m[0], sgd, None).resume({"step": 0})


def test_after_falling_back_the_job_saves_again_on_one_timeline(tmp_path):
    """Resume fell back past steps 2 and 3 (corrupt) to 1. The old code then refused the
    re-save of step 2 (FileExistsError: already committed); and with a new step number,
    retention could delete the new save while it kept the abandoned step 3. Now the first save
    after the fallback discards the newer steps once it is committed, and resume then loads it."""
    url = tmp_path / "ck"
    a = _build(0)
    ckpt = _manager(url, *a, async_save=False, keep_last=3)
    for step in (1, 2, 3):
        _train(*a, steps=1)
        ckpt.save(step, {"step": step})
    _corrupt_newest(url, 3)
    _corrupt_newest(url, 2)

    b = _build(5)
    lines: list[str] = []
    resumed = _manager(url, *b, keep_last=2, log=lines.append)
    info = resumed.resume({"step": 0})
    assert info.step == 1 and [s for s, _ in info.skipped] == [3, 2] and len(lines) == 2
    _train(*b, steps=1, seed=7)
    resumed.save(2, {"step": 2})  # async: the same step number as the abandoned one
    resumed.close()
    assert storage.list_steps(str(url)) == [1, 2]  # 3 discarded, 2 replaced
    saved = {k: v.clone() for k, v in b[0].state_dict().items()}
    _train(*b, steps=1, seed=8)
    resumed.save(3, {"step": 3}, block=True)  # no longer behind anything
    assert storage.list_steps(str(url)) == [2, 3]

    c = _build(9)
    template = {"step": 0}
    again = _manager(url, *c).resume(template)
    assert again.step == 3 and again.skipped == [] and template == {"step": 3}
    two = storage.load_state_dict(str(url), 2)  # the new save of 2, not the abandoned one
    assert all(torch.equal(two[f"model.{k}"], v) for k, v in saved.items() if k != "lm_head.weight")


def test_a_newer_step_without_a_fallback_is_an_error(tmp_path):
    """A newer committed step that the resume did not fall back past (another writer's) makes
    the save fail with an error that names it, instead of saving behind it."""
    url = tmp_path / "ck"
    a = _build(0)
    ckpt = _manager(url, *a, async_save=False)
    _train(*a, steps=1)
    ckpt.save(1, {"step": 1})
    b = _build(1)
    other = _manager(url, *b, async_save=False)
    assert other.resume({"step": 0}).step == 1
    ckpt.save(5, {"step": 5})  # e.g. a second job on the same root
    with pytest.raises(storage.CheckpointError, match=r"newer than it exist: \[5\]"):
        other.save(2, {"step": 2})
    assert storage.list_steps(str(url)) == [1, 5]
