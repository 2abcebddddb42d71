"""CheckpointManager in one process: round trip of model, optimizer, scheduler, RNG and trainer
values; fallback from a corrupt newest step; what must not fall back; async errors surface."""

from __future__ import annotations

import json
import pathlib
import random
import time

import numpy as np
import pytest
import torch

import ftsdp
from ftsdp import storage
from ftsdp.checkpoint import RootInUseError
from ftsdp.checkpoint._manager import CheckpointManager
from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups

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
    with pytest.raises(ValueError, match="not one of the model's"):
        CheckpointManager(str(tmp_path), torch.nn.Linear(2, 2), m[1])
    with pytest.raises(TypeError, match="must be an nn.Module"):
        CheckpointManager(str(tmp_path), object(), m[1])
    lbfgs = torch.optim.LBFGS(m[0].parameters())  # needs a closure: no state to load into
    with pytest.raises(ValueError, match="cannot create the state of LBFGS"):
        _manager(tmp_path / "ck", m[0], lbfgs, None).resume({"step": 0})


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
    with pytest.raises(RootInUseError, match=r"step\(s\) \[5\] .* resumed from step 1") as e:
        other.save(2, {"step": 2})
    assert "newer than it exist: [5]" in str(e.value.__cause__)  # storage's own refusal
    assert storage.list_steps(str(url)) == [1, 5]


# -- any engine, any element-wise optimizer (one process: ftsdp.FSDP and a plain module) ------


class _Tiny(torch.nn.Module):
    """Two layers and a parameter no step reaches (it never gets optimizer state)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


_OPTIMIZERS = {
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05, lr_decay=0.01),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=0.01, momentum=0.5, centered=True),
    "adamw-amsgrad": lambda groups: torch.optim.AdamW(groups, lr=0.01, amsgrad=True),
}


def _tiny(engine: str, optimizer: str, seed: int):
    torch.manual_seed(seed)
    model = _Tiny()
    if engine == "ftsdp":
        model = ftsdp.FSDP(model)
    named = list(model.named_parameters())
    groups = [  # two groups: names must map back to the right group
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    return model, _OPTIMIZERS[optimizer](groups)


def _tiny_steps(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _snapshot(model, opt) -> tuple[dict, list]:
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    state = [
        {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        if p in opt.state
        else None
        for g in opt.param_groups
        for p in g["params"]
    ]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return sd, [state, groups]


def _assert_snapshots_equal(a, b) -> None:
    (sda, (sta, ga)), (sdb, (stb, gb)) = a, b
    assert sda.keys() == sdb.keys()
    for k in sda:
        assert torch.equal(sda[k], sdb[k]), k
    assert [s is None for s in sta] == [s is None for s in stb]
    for x, y in zip(sta, stb, strict=True):
        if x is not None:
            assert x.keys() == y.keys()
            for k in x:
                assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
    assert ga == gb


@pytest.mark.parametrize("engine", ["ftsdp", "module"])
@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
def test_any_elementwise_optimizer_round_trips_bitwise(tmp_path, engine, optimizer):
    """SGD with momentum, Adagrad, RMSprop and AdamW with amsgrad, on ftsdp.FSDP and on a plain
    module: the resumed state is the saved one bit for bit (a parameter no step reached has no
    state, before and after; the param groups' hyper-parameters come back), and training goes on
    exactly like the uninterrupted run. The old code refused all but Adam, AdamW and plain SGD,
    and any model without sharded_state_dict()."""
    url = str(tmp_path / "ck")
    model, opt = _tiny(engine, optimizer, 0)
    _tiny_steps(model, opt, 3, seed=1)
    opt.param_groups[1]["lr"] = 0.0123  # changed after construction: must come from the save
    ckpt = CheckpointManager(url, model, opt, keep_last=1)
    ckpt.save(3, {"step": 3})
    ckpt.close()
    saved = _snapshot(model, opt)
    # unused.bias has no state (Adagrad creates its state up front)
    assert (saved[1][0][-1] is None) == (optimizer != "adagrad")
    _tiny_steps(model, opt, 2, seed=2)
    expected = _snapshot(model, opt)

    model2, opt2 = _tiny(engine, optimizer, 7)
    resumed = CheckpointManager(url, model2, opt2)
    assert resumed.engine.kind == engine
    assert resumed.resume({"step": 0}).step == 3
    _assert_snapshots_equal(_snapshot(model2, opt2), saved)
    _tiny_steps(model2, opt2, 2, seed=2)
    _assert_snapshots_equal(_snapshot(model2, opt2), expected)


@pytest.mark.parametrize("engine", ["ftsdp", "module"])
def test_a_save_before_the_first_step_resumes_without_optimizer_state(tmp_path, engine):
    """A save before any step (no optimizer state yet) resumes to no state, so Adam's first step
    is still its first (the old code created zero state with step 0 and then failed: the
    checkpoint had no optimizer state to load into it). Saving does not create state either."""
    url = str(tmp_path / "ck")
    model, opt = _tiny(engine, "adamw-amsgrad", 0)
    CheckpointManager(url, model, opt, async_save=False).save(0, {"step": 0})
    assert not opt.state
    saved = _snapshot(model, opt)
    _tiny_steps(model, opt, 2, seed=2)
    expected = _snapshot(model, opt)

    model2, opt2 = _tiny(engine, "adamw-amsgrad", 7)
    assert CheckpointManager(url, model2, opt2).resume({"step": 0}).step == 0
    assert not opt2.state
    _assert_snapshots_equal(_snapshot(model2, opt2), saved)
    _tiny_steps(model2, opt2, 2, seed=2)
    _assert_snapshots_equal(_snapshot(model2, opt2), expected)


class _Custom(torch.optim.Optimizer):
    """Element-wise, with a Python value in its state, and optionally a tensor of its own size
    (like a factored moment: not a per-element range of the parameter)."""

    def __init__(self, params, lr: float = 0.1, odd: bool = False) -> None:
        super().__init__(params, {"lr": lr, "odd": odd})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["avg"], st["step"], st["seen"] = torch.zeros_like(p), torch.zeros(()), 0
                    if group["odd"]:
                        st["odd"] = torch.zeros(3)
                st["avg"].mul_(0.5).add_(p.grad)
                st["step"] += 1
                st["seen"] += 1
                p.add_(st["avg"], alpha=-group["lr"])


@pytest.mark.parametrize("engine", ["ftsdp", "module"])
def test_json_optimizer_state_round_trips_and_unreshardable_state_is_refused(tmp_path, engine):
    model, opt = _tiny(engine, "adagrad", 0)
    opt = _Custom(model.parameters())
    _tiny_steps(model, opt, 2, seed=1)
    CheckpointManager(str(tmp_path / "ck"), model, opt, async_save=False).save(2, {"step": 2})
    saved = _snapshot(model, opt)
    model2, _ = _tiny(engine, "adagrad", 3)
    opt2 = _Custom(model2.parameters())
    CheckpointManager(str(tmp_path / "ck"), model2, opt2).resume({"step": 0})
    _assert_snapshots_equal(_snapshot(model2, opt2), saved)
    assert opt2.state[next(iter(model2.parameters()))]["seen"] == 2

    odd = _Custom(model.parameters(), odd=True)
    _tiny_steps(model, odd, 1, seed=1)
    ckpt = CheckpointManager(str(tmp_path / "odd"), model, odd, async_save=False)
    if engine == "module":  # whole tensors: nothing to reshard
        ckpt.save(1, {"step": 1})
    else:
        with pytest.raises(
            ValueError, match=r"optimizer state a\.weight\.odd .* cannot be resharded"
        ):
            ckpt.save(1, {"step": 1})


def _draws() -> tuple[float, list[float], list[float], float]:
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), random.gauss()


@pytest.mark.parametrize("form", ["current", "lists"])
def test_rng_states_restore_from_either_saved_form(form):
    """The RNG entry restores every generator, mid-Gaussian-pair included, from the base64 key
    arrays written now and from the JSON lists written before them."""
    from ftsdp.checkpoint import _state as cs

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.gauss(), np.random.standard_normal()  # a cached second Gaussian in both
    if form == "current":
        saved = cs.rng_state()
    else:  # what rng_state wrote before the key arrays became base64
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, internal, gauss_next = random.getstate()
        saved = json.dumps(
            {
                "torch": json.loads(cs.rng_state())["torch"],
                "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
                "python": [version, list(internal), gauss_next],
            }
        )
    expected = _draws(), np.random.standard_normal()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    cs.set_rng_state(saved)
    assert (_draws(), np.random.standard_normal()) == expected


def test_a_param_group_value_that_is_not_json_is_named(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    manager = _manager(tmp_path / "ck", model, opt, sched)
    opt.param_groups[1]["tag"] = object()
    with pytest.raises(TypeError, match="param group value 'tag' is a object"):
        manager.save(1, {})
    opt.param_groups[1]["tag"] = ("a", torch.tensor(2.0))  # tuples and tensors become lists
    manager.save(1, {}, block=True)
    values = storage.LazyStateDict(str(tmp_path / "ck"), step=1).values
    groups = json.loads(values["optim.param_groups"])
    assert groups[1]["tag"] == ["a", 2.0]


def test_close_after_a_resume_alone_deletes_nothing(tmp_path):
    """An evaluation script's manager (default keep_last=3) that only resumes must not apply
    its retention to the training run's root (keep_last=10)."""
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = CheckpointManager(str(root), model, opt, every_steps=1, keep_last=10)
    for step in range(1, 7):
        train.save(step, {"step": step})
    train.close()
    assert storage.list_steps(str(root)) == [1, 2, 3, 4, 5, 6]
    model2 = torch.nn.Linear(8, 8)
    evaluation = CheckpointManager(str(root), model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    evaluation.resume({"step": 0})
    evaluation.close()
    assert storage.list_steps(str(root)) == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        f"step-{s}" for s in range(1, 7)
    ]
