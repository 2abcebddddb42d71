"""The walk of the engine's tensors kept from one save to the next (``KeptWalk``, the manager's
own): every save still holds exactly the state of its moment, across whatever changes between
saves: optimizer state created after the first save, values changed in place, a parameter's or
a state tensor's memory replaced, a dtype or shape changed, non-tensor values (trainer values,
param groups, RNG states, a non-tensor optimizer value) changed.

The reference is the live state cloned at the moment of each save; every step is loaded back and
compared bitwise. The same sequence runs through the in-process deferred save (a disk root: the
snapshot copy; tmpfs: written from the live tensors) and through the persister (a job of one
rank, this process).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager
from ftsdp.checkpoint import _state as cs
from ftsdp.storage.format._state import WalkedPart, flatten_state, walk_part

pytestmark = pytest.mark.timeout(240)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.zero_grad()


def _moment(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> dict[str, Any]:
    """What a save taken now must hold, by saved name: tensors cloned, values as JSON."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, entry in opt.state.items():
        for key, value in entry.items():
            name = f"optim.state.{names[id(p)]}.{key}"
            tensor = isinstance(value, torch.Tensor)
            out[name] = value.detach().clone() if tensor else copy.deepcopy(value)
    out.update({f"trainer.{k}": v for k, v in trainer.items()})
    out["rng"] = cs.rng_state()  # nothing draws a number between this and the save
    out["lr"] = [g["lr"] for g in opt.param_groups]
    return out


def _check(url: str, step: int, want: dict[str, Any]) -> None:
    saved: dict[str, Any] = storage.load_state_dict(url, step)
    saved.update(storage.catalog.read_manifest(url, step).values)  # (one rank: all of them)
    want = dict(want)
    lr = want.pop("lr")
    assert [g["lr"] for g in json.loads(saved.pop("optim.param_groups"))] == lr, step
    assert set(saved) == set(want), (step, set(saved) ^ set(want))
    for name, value in want.items():
        got = saved[name]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape, (step, name)
            assert torch.equal(got, value), (step, name)
        else:
            assert got == value, (step, name)


Change = Callable[[nn.Module, torch.optim.Optimizer, dict], None]


def _replace_memory(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    with torch.no_grad():  # the same Parameter object over new memory (a load that reallocates)
        model[0].weight.data = model[0].weight.data.clone() * 2


def _replace_state(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors (a resume)
    with torch.no_grad():
        opt.state[model[2].bias]["exp_avg"].add_(1)


def _new_dtype(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    with torch.no_grad():
        model[2].bias.data = model[2].bias.data.double() + 0.25


def _new_shape(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    opt.state[model[2].bias]["exp_avg_sq"] = torch.arange(12.0).reshape(3, 4)  # a non-mirror


def _values(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    trainer["cursor"] += 7
    opt.param_groups[0]["lr"] = 0.125
    torch.rand(3)  # the RNG moves on
    opt.state[model[0].bias]["note"] = [1, 2]  # a non-tensor optimizer value appears


def _value_in_place(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    opt.state[model[0].bias]["note"].append(3)  # the same list, changed


def _transpose(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    with torch.no_grad():  # the same memory, shape and dtype; other strides
        model[0].weight.data = model[0].weight.data.t()


def _in_place(model: nn.Module, opt: torch.optim.Optimizer, trainer: dict) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.5)


# (what changes before the save, whether the kept walk must be walked again)
CHANGES: list[tuple[str, Change, bool]] = [
    ("no optimizer state yet", lambda m, o, t: None, True),
    ("optimizer state created after the first save", lambda m, o, t: _train(m, o), True),
    ("values changed by a step", lambda m, o, t: _train(m, o), False),
    ("values changed in place outside a step", _in_place, False),
    ("a parameter's memory replaced", _replace_memory, True),
    ("the optimizer's state tensors replaced", _replace_state, True),
    ("a parameter's strides changed over the same memory", _transpose, True),
    ("a parameter's dtype changed", _new_dtype, True),
    ("a state tensor's shape changed", _new_shape, True),
    ("non-tensor values changed", _values, True),
    ("a non-tensor optimizer value changed in place", _value_in_place, True),
    ("nothing", lambda m, o, t: None, False),
]


def _sequence(ckpt: CheckpointManager, model: nn.Module, opt: torch.optim.Optimizer) -> list:
    """Save after each change; return ``(step, what the save must hold)`` per save."""
    trainer = {"step": 0, "cursor": 0}
    wants = []
    for step, (what, change, walked) in enumerate(CHANGES, start=1):
        change(model, opt, trainer)
        trainer["step"] = step
        kept = ckpt._walk.model, ckpt._walk.optim
        wants.append((step, _moment(model, opt, trainer)))
        ckpt.save(step, trainer)
        ckpt.wait_snapshot()
        if step > 1:  # the walk is kept exactly while nothing it holds changed
            again = ckpt._walk.model is not kept[0] or ckpt._walk.optim is not kept[1]
            assert again == walked, what
        ckpt.wait()
    return wants


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_every_save_holds_its_moment_across_changes(
    where: str, tmp_path: Path, shm_path: Path
) -> None:
    model, opt = _model()
    url = str((tmp_path if where == "disk" else shm_path) / "ckpt")
    ckpt = CheckpointManager(url, model, opt, keep_last=None)
    ckpt.resume({"step": 0, "cursor": 0})
    wants = _sequence(ckpt, model, opt)
    ckpt.close()
    for step, want in wants:
        _check(url, step, want)


def test_a_fresh_manager_saves_what_the_kept_walk_saved(tmp_path: Path) -> None:
    """After all the changes, a manager that never kept anything writes the same step."""
    model, opt = _model()
    ckpt = CheckpointManager(str(tmp_path / "a"), model, opt, keep_last=None)
    _sequence(ckpt, model, opt)
    step = len(CHANGES) + 1
    trainer = {"step": step, "cursor": 7}
    ckpt.save(step, trainer, block=True)
    ckpt.close()
    fresh = CheckpointManager(str(tmp_path / "b"), model, opt, async_save=False)
    fresh.save(step, trainer)
    fresh.close()
    a, b = (
        {
            **storage.load_state_dict(str(tmp_path / n), step),
            **storage.catalog.read_manifest(str(tmp_path / n), step).values,
        }
        for n in "ab"
    )
    a.pop("rng"), b.pop("rng")  # (each save reads the RNG states of its own moment)
    assert set(a) == set(b)
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[name].dtype and torch.equal(value, b[name]), name
        else:
            assert value == b[name], name


def test_buffers_are_copied_at_every_deferred_save_from_a_kept_walk(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    url = str(tmp_path / "ckpt")
    ckpt = CheckpointManager(url, model, opt)
    ckpt.resume({"step": 0})
    wants, kept = [], []
    for step in (1, 2, 3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        wants.append({k: v.clone() for k, v in model.state_dict().items()})
        ckpt.save(step, {"step": step})
        model(torch.randn(4, 8))  # forward changes the buffers right after the save
        kept.append(ckpt._walk.model)
        ckpt.wait()
    assert kept[1] is kept[2]  # the walk was kept; the buffers were copied from it
    assert ckpt._walk.buffers == [
        "model.1.running_mean",
        "model.1.running_var",
        "model.1.num_batches_tracked",
    ]
    ckpt.close()
    for step, want in enumerate(wants, start=1):
        saved = storage.load_state_dict(url, step)
        for k, v in want.items():
            assert torch.equal(saved[f"model.{k}"], v), (step, k)


def test_every_persisted_save_holds_its_moment_across_changes(tmp_path: Path) -> None:
    """Through the persister, started by this process as rank 0 of a job of one (no process
    group: a rank spawned for it spent seconds importing torch; the persister process is
    separate either way)."""
    model, opt = _model()
    url = f"{tmp_path}/durable"
    ckpt = CheckpointManager(url, model, opt, persister=True, keep_last=None)
    ckpt.resume({"step": 0, "cursor": 0})
    try:
        wants = _sequence(ckpt, model, opt)
        assert ckpt._snap is not None and ckpt._snap.on and ckpt._snap.proc is not None
    finally:
        ckpt.close()
    for step, want in wants:
        _check(url, step, want)


def test_a_walked_part_goes_back_only_in_its_place_and_never_over_another_name() -> None:
    t = torch.arange(4.0)
    part = walk_part({"w": t, "n": 3}, "model")
    tensors, values = flatten_state({"model": part, "x": 1})
    assert list(tensors) == ["model.w"] and tensors["model.w"].local is t
    assert values["model.n"].value == 3 and values["x"].value == 1
    with pytest.raises(ValueError, match="walked for 'model'"):
        flatten_state({"other": part})
    with pytest.raises(ValueError, match="same name 'model.w'"):
        flatten_state({"model.w": t, "model": part})
    with pytest.raises(ValueError, match="same name 'model.w'"):
        flatten_state({"model": part, "model.w": t})
    copied = part.with_locals({"model.w": t.clone()})
    assert isinstance(copied, WalkedPart) and copied.tensors["model.w"].local is not t
    assert part.tensors["model.w"].local is t  # the kept part is not changed
    with pytest.raises(ValueError, match="replacement"):
        part.with_locals({"model.w": torch.zeros(5)})


class _Counted(nn.Module):
    """A module whose extra state is a tensor made anew at every call (as an FP8 module's
    scaling history is): no parameter or buffer changes when it does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.counter])

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.counter = int(state[0])


def test_a_tensor_extra_state_is_read_at_every_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    url = str(tmp_path / "ckpt")
    ckpt = CheckpointManager(url, model, opt, keep_last=None)
    ckpt.resume({"step": 0})
    for step in (1, 2, 3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        model.counter = 10 * step
        ckpt.save(step, {"step": step})
        ckpt.wait()
    ckpt.close()
    for step in (1, 2, 3):
        saved = storage.load_state_dict(url, step)
        assert saved["model._extra_state"].tolist() == [10 * step], step
