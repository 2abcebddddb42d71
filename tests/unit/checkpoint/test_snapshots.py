"""Deferred snapshots in one process: ``save`` returns before copying, the fence keeps the
optimizer from changing what is being copied, and the engines' reused state dicts stay exact.

The reference is the state itself, cloned at the moment of the save."""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager
from ftsdp.checkpoint._engines import engine_for
from ftsdp.storage.io._streaming import piece_bytes
from ftsdp.storage.saving import _save


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()


def _step_waits_for(
    model: nn.Module, opt: torch.optim.Optimizer, release: threading.Event, what: str
) -> None:
    """A training step on another thread does not get past ``optimizer.step()`` until the test
    sets ``release`` (the held snapshot work), and then does."""
    stepped = threading.Event()

    def step() -> None:
        _train(model, opt)
        stepped.set()

    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.3)
    assert not stepped.is_set(), f"optimizer.step() ran while {what}"
    release.set()
    t.join(30)
    assert stepped.is_set()


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every deferred snapshot copy until the test releases it (set the event)."""
    release = threading.Event()
    for name in ("copy_into", "copy_cpu"):  # (from CUDA, on the CPU)
        real = getattr(_save, name)

        def held(*args: Any, real: Any = real, **kwargs: Any) -> Any:
            assert release.wait(30), "the test never released the snapshot copy"
            return real(*args, **kwargs)

        monkeypatch.setattr(_save, name, held)
    return release


def test_save_returns_before_copying_and_the_step_waits_for_the_copy(
    tmp_path: Any, slow_copies: threading.Event
) -> None:
    model, opt = _model()
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), model, opt)
    assert ckpt.resume({"step": 0}) is None  # a fresh start; prepares the deferred saves
    moment = {k: v.clone() for k, v in model.state_dict().items()}
    moment_avg = {id(p): s["exp_avg"].clone() for p, s in opt.state.items()}
    blocked = ckpt.save(1, {"step": 1})
    assert not ckpt._durable.pending.snapshot_taken()  # returned with nothing copied yet
    assert blocked < 5  # (generous: the copy is held, the call must not wait for it)

    _step_waits_for(model, opt, slow_copies, "the snapshot was being taken")
    ckpt.close()

    saved = storage.load_state_dict(str(tmp_path / "ckpt"))
    for k, v in moment.items():
        assert torch.equal(saved[f"model.{k}"], v), k
        assert not torch.equal(model.state_dict()[k], v)  # the step did change it afterwards
    names = {id(p): n for n, p in model.named_parameters()}
    for pid, avg in moment_avg.items():
        assert torch.equal(saved[f"optim.state.{names[pid]}.exp_avg"], avg)


def test_a_tmpfs_root_is_written_from_the_live_tensors_and_the_step_waits_for_the_writes(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On tmpfs there is no snapshot memory: the objects are written from the live tensors,
    and the optimizer step waits until they are."""
    release, copies = threading.Event(), []
    real_write = _save.write_object

    def held(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(30), "the test never released the write"
        return real_write(*args, **kwargs)

    monkeypatch.setattr(_save, "write_object", held)
    monkeypatch.setattr(_save, "copy_into", lambda *a, **k: copies.append(a))
    model, opt = _model()
    url = f"{shm_path}/ckpt"
    ckpt = CheckpointManager(url, model, opt)
    assert ckpt.resume({"step": 0}) is None
    assert _save._lanes[url].arena.held_bytes() == 0  # nothing reserved for a copy
    moment = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(1, {"step": 1})
    assert not ckpt._durable.pending.snapshot_taken()
    _step_waits_for(model, opt, release, "the objects were being written")
    ckpt.wait()
    assert copies == [] and _save._lanes[url].arena.held_bytes() == 0
    ckpt.close()
    saved = storage.load_state_dict(url)
    for k, v in moment.items():
        assert torch.equal(saved[f"model.{k}"], v), k
        assert not torch.equal(model.state_dict()[k], v)


def test_piece_bytes_are_the_elements_in_row_major_order() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = [
        torch.randn(10, 7, generator=g),
        torch.randn(8, 8, generator=g).t(),  # not contiguous: copied
        torch.randn(33, generator=g).to(torch.bfloat16)[1:],  # an odd storage offset
        torch.randint(0, 9, (5, 3), generator=g, dtype=torch.int64),
        torch.randn(6, generator=g, dtype=torch.complex64).conj(),  # a lazy conjugate
        nn.Parameter(torch.randn(12, generator=g)),  # requires grad
    ]
    for t in tensors:
        n = t.numel()
        for start, length in ((0, n), (3, n - 5), (n - 1, 1), (2, 0)):
            want = t.detach().resolve_conj().reshape(-1)[start : start + length].clone()
            got = piece_bytes(t, start, length)
            assert bytes(got) == want.view(torch.uint8).numpy().tobytes(), (t.shape, start)
        with pytest.raises(ValueError, match="changed size"):  # never read past the tensor
            piece_bytes(t, n - 1, 2)


def test_close_takes_the_fence_off_and_sync_saves_have_none(tmp_path: Any) -> None:
    model, opt = _model()
    ckpt = CheckpointManager(str(tmp_path / "a"), model, opt)
    assert len(opt._optimizer_step_pre_hooks) == 1
    ckpt.close()
    assert len(opt._optimizer_step_pre_hooks) == 0
    CheckpointManager(str(tmp_path / "b"), model, opt, async_save=False)
    CheckpointManager(str(tmp_path / "c"), model, opt, defer_copy=False)
    assert len(opt._optimizer_step_pre_hooks) == 0


def test_a_bad_state_raises_at_once_and_the_next_save_works(tmp_path: Any) -> None:
    url = str(tmp_path / "s")
    with pytest.raises(TypeError, match="bad"):
        storage.save({"bad": object()}, url, 1, async_save=True, defer_copy=True)
    storage.saving.wait_snapshot(5)  # nothing left holding the fence
    h = storage.save({"x": torch.arange(4.0)}, url, 2, async_save=True, defer_copy=True)
    h.wait(30)
    assert storage.list_steps(url) == [2]
    with pytest.raises(ValueError, match="async_save"):
        storage.save({"x": torch.zeros(1)}, url, 3, defer_copy=True)


@pytest.mark.parametrize("budget", [None, 64, "tmpfs"])
def test_the_copy_is_exact_whatever_the_staging(
    tmp_path: Any, request: pytest.FixtureRequest, budget: int | str | None
) -> None:
    """Arena (everything fits), one object at a time within a tiny budget, or no copy at all
    (a tmpfs root, written from the tensors themselves): same bytes."""
    if budget == "tmpfs":
        tmp_path, budget = request.getfixturevalue("shm_path"), None
    g = torch.Generator().manual_seed(1)
    state = {
        "a": torch.randn(1000, generator=g),
        "b": torch.randint(0, 100, (7, 3), generator=g, dtype=torch.int64),
        "c": torch.randn(5, generator=g).to(torch.bfloat16),
        "t": torch.randn(8, 8, generator=g).t(),  # not contiguous
    }
    want = {k: v.clone() for k, v in state.items()}
    options = storage.SaveOptions(staging_budget_bytes=budget or 1 << 30, object_bytes=2048)
    h = storage.save(state, str(tmp_path), 1, async_save=True, defer_copy=True, options=options)
    h.wait_snapshot(30)
    for v in state.values():
        v.zero_()
    h.wait(30)
    got = storage.load_state_dict(str(tmp_path))
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_saves_into_the_kept_arena_follow_changed_values_and_layouts(tmp_path: Any) -> None:
    """The tensors the copy goes into are kept while the layout (dtypes and sizes) stays the
    same; new values, a new dtype of the same size and a new size are all saved exactly."""
    url = str(tmp_path)
    kept: list[set[int]] = []
    weight = nn.Parameter(torch.randn(100))  # requires grad: copied without autograd
    state: dict[str, Any] = {"w": weight, "b": torch.arange(6), "s": torch.tensor(3.0)}
    for step, change in enumerate(
        [
            lambda: None,
            lambda: state["b"].add_(7),  # same layout, new values
            lambda: state.update(b=torch.arange(6, dtype=torch.float64) / 3),  # same bytes
            lambda: state.update(b=torch.arange(9)),  # another size
        ],
        start=1,
    ):
        change()
        with torch.no_grad():
            weight.mul_(2)
        want = {k: v.detach().clone() for k, v in state.items()}
        h = storage.save(state, url, step, async_save=True, defer_copy=True)
        h.wait(30)
        got = storage.load_state_dict(url, step=step)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (step, k)
        leaves = _save._lanes[url].arena._leaves
        assert leaves is not None
        kept.append({t.data_ptr() for t in leaves[1]})
    # the second save reused the first one's tensors; a new dtype or size made new ones
    assert [kept[i] == kept[i - 1] for i in (1, 2, 3)] == [True, False, False]


def test_reused_state_dicts_follow_replaced_tensors_and_the_current_lr() -> None:
    model, opt = _model()
    engine = engine_for(model, opt)
    first = engine.optim_state()
    again = engine.optim_state()
    name = next(iter(first["state"]))
    assert again["state"][name]["exp_avg"] is first["state"][name]["exp_avg"]  # reused

    for group in opt.param_groups:
        group["lr"] = 0.5
    assert '"lr": 0.5' in engine.optim_state()["param_groups"]

    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors, same values
    fresh = engine.optim_state()["state"][name]["exp_avg"]
    live = opt.state[dict(model.named_parameters())[name]]["exp_avg"]
    assert fresh.data_ptr() == live.data_ptr() != first["state"][name]["exp_avg"].data_ptr()

    before = engine.model_state()["0.weight"]
    model[0].weight = nn.Parameter(torch.ones(64, 64))  # a replaced parameter
    after = engine.model_state()["0.weight"]
    assert after.data_ptr() == model[0].weight.data_ptr() != before.data_ptr()


def test_each_save_gets_dicts_of_its_own_over_the_same_leaves_until_a_tensor_is_replaced() -> None:
    """The engine hands every call plain dicts of its own (a save or a load target may change
    them), over the same leaves while nothing was replaced, new ones once something was; a
    deferred save's buffers are copies."""
    model, opt = _model()
    engine = engine_for(model, opt)
    model_part, optim_part = engine.model_state(), engine.optim_state()["state"]
    assert type(model_part) is dict and all(type(e) is dict for e in optim_part.values())
    assert engine.copy_buffers(model_part) is model_part  # no buffers: nothing copied
    again, optim_again = engine.model_state(), engine.optim_state()["state"]
    assert again is not model_part and again["0.weight"] is model_part["0.weight"]
    name = next(iter(optim_part))
    assert optim_again[name] is not optim_part[name]
    assert optim_again[name]["exp_avg"] is optim_part[name]["exp_avg"]

    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors
    live = opt.state[dict(model.named_parameters())[name]]["exp_avg"]
    fresh = engine.optim_state()["state"][name]["exp_avg"]
    assert fresh.data_ptr() == live.data_ptr() != optim_part[name]["exp_avg"].data_ptr()
    model[0].weight = nn.Parameter(torch.ones(64, 64))  # a replaced parameter
    renewed = engine.model_state()["0.weight"]
    assert renewed.data_ptr() == model[0].weight.data_ptr() != model_part["0.weight"].data_ptr()

    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bn_engine = engine_for(bn, torch.optim.SGD(bn.parameters(), lr=0.1))
    part = bn_engine.model_state()
    copied = bn_engine.copy_buffers(part)  # buffers change in forward: copied at every save
    assert copied["1.running_mean"] is not part["1.running_mean"]
    assert torch.equal(copied["1.running_mean"], part["1.running_mean"])
    assert copied["0.weight"] is part["0.weight"]


# -- the memory tier ----------------------------------------------------------------------------


def _run(tmp_path: Any, steps: int, **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Train ``steps`` steps with a durable save every 4 steps and a memory save every step;
    the manager is not closed (a crash)."""
    model, opt = _model()
    ckpt = CheckpointManager(
        str(tmp_path / "durable"), model, opt, memory_url=str(tmp_path / "shm"), **kw
    )
    start = ckpt.resume({"step": 0})
    for step in range((start.step if start else 0) + 1, steps + 1):
        _train(model, opt)
        if step % 4 == 0:
            ckpt.save(step, {"step": step})
            ckpt.wait()  # a step is longer than an upload here
        else:
            ckpt.save_to_memory(step, {"step": step})
    ckpt.wait()
    return model, opt, ckpt


def test_a_restart_resumes_from_the_memory_tier_and_falls_back_to_durable(tmp_path: Any) -> None:
    model, _, _ = _run(tmp_path, 6)
    assert storage.list_steps(str(tmp_path / "durable")) == [4]
    assert storage.list_steps(str(tmp_path / "shm")) == [5, 6]  # memory_keep=2
    want = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_opt = _model()
    again = CheckpointManager(
        str(tmp_path / "durable"), fresh, fresh_opt, memory_url=str(tmp_path / "shm")
    )
    trainer: dict[str, Any] = {"step": 0}
    info = again.resume(trainer)
    assert info is not None and info.step == 6 and trainer["step"] == 6
    assert again.resumed_from == str(tmp_path / "shm")
    assert again.last_saved_step == 4  # the durable tier's newest: step 6 is not there yet
    for k, v in want.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    again.close()  # a clean end clears the memory tier, and only it
    assert not (tmp_path / "shm").exists()
    assert storage.list_steps(str(tmp_path / "durable")) == [4]


def test_a_damaged_memory_step_falls_back_to_the_next_one(tmp_path: Any) -> None:
    _run(tmp_path, 6)
    data = next((tmp_path / "shm" / "step-6").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    model, opt = _model()
    again = CheckpointManager(
        str(tmp_path / "durable"), model, opt, memory_url=str(tmp_path / "shm")
    )
    info = again.resume({"step": 0})
    assert info is not None and info.step == 5 and again.resumed_from == str(tmp_path / "shm")
    # the next memory save starts a new timeline there: step 6 (damaged) is replaced
    _train(model, opt)
    again.save_to_memory(6, {"step": 6})
    again.wait()
    assert storage.list_steps(str(tmp_path / "shm")) == [5, 6]
    assert storage.catalog.verify(str(tmp_path / "shm"), 6).ok


def test_memory_saves_go_on_while_a_durable_upload_is_stuck(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each root has its own lane: a durable upload that does not finish (a slow object store)
    holds neither the memory tier's saves nor the optimizer's fence."""
    from ftsdp.storage.io._fs import Store

    release = threading.Event()
    real = Store._write_once
    durable = str(tmp_path / "durable")

    def slow(self: Store, rel: str, produce: Any) -> None:
        if self.where().startswith(durable) and rel.endswith(".safetensors"):
            assert release.wait(30)
        real(self, rel, produce)

    monkeypatch.setattr(Store, "_write_once", slow)
    model, opt = _model()
    ckpt = CheckpointManager(durable, model, opt, memory_url=str(tmp_path / "shm"))
    ckpt.resume({"step": 0})
    ckpt.save(1, {"step": 1})  # its upload hangs until released
    for step in (2, 3):
        _train(model, opt)  # the fence: the durable snapshot is taken, the upload may hang
        ckpt.save_to_memory(step, {"step": step})
        ckpt._memory.wait()
    assert storage.list_steps(str(tmp_path / "shm")) == [2, 3]
    assert ckpt.in_flight() and storage.list_steps(durable) == []
    release.set()
    ckpt.close()
    assert storage.list_steps(durable) == [1] and not (tmp_path / "shm").exists()
    with pytest.raises(ValueError, match="memory_every"):
        CheckpointManager(str(tmp_path / "x"), model, opt, memory_url="m", memory_every=0)


def test_a_save_with_retention_reads_back_as_written(tmp_path: Any) -> None:
    """After a save and its retention the root holds the new step only, and its manifest reads
    back as the object that encodes to the file's bytes."""
    from ftsdp.storage.format._manifest import Manifest

    url = str(tmp_path / "ckpt")
    state = {"w": torch.randn(64), "b": torch.arange(5.0)}
    storage.save(state, url, step=1, options=storage.SaveOptions(keep_last=1))
    storage.save(state, url, step=2, options=storage.SaveOptions(keep_last=1))
    assert storage.list_steps(url) == [2]
    written = storage.catalog.read_manifest(url)
    data = (tmp_path / "ckpt" / "step-2" / "manifest.json").read_bytes()
    assert written.to_json() == data and written == Manifest.from_json(data, where=url)


def test_each_save_writes_with_at_most_its_own_io_threads(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save writes at most ``io.threads`` objects at once, on the root's writer threads,
    also when an earlier save to the root asked for more."""
    running, most, lock = [0], [0], threading.Lock()
    real = _save._SaveJob._write

    def write(self: Any, *args: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        try:
            return real(self, *args)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(_save._SaveJob, "_write", write)
    state = {f"t{i}": torch.full((300,), float(i)) for i in range(8)}  # 8 objects of 1200 bytes
    url = str(tmp_path)
    for step, threads in ((1, 4), (2, 1)):
        options = storage.SaveOptions(object_bytes=1200, io=storage.IOOptions(threads=threads))
        most[0] = 0
        h = storage.save(state, url, step, async_save=True, defer_copy=True, options=options)
        h.wait(30)
        # at most its own threads (one at a time in the second save); the first did overlap
        assert most[0] <= threads and (threads == 1 or most[0] >= 2), (step, most[0])
    got = storage.load_state_dict(url, step=2)
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_failed_write_on_a_tmpfs_root_fails_that_save_only(
    shm_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written from the live tensors, a write that fails releases the fence, fails its save
    (nothing committed) and leaves the next save to work."""
    real_write = _save.write_object
    calls = []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk on fire")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(_save, "write_object", failing_once)
    url = f"{shm_path}/s"
    state = {"x": torch.arange(8.0)}
    h = storage.save(state, url, 1, async_save=True, defer_copy=True)
    h.wait_snapshot(30)  # released although the write failed
    with pytest.raises(OSError, match="disk on fire"):
        h.wait(30)
    assert storage.list_steps(url) == []
    storage.save(state, url, 2, async_save=True, defer_copy=True).wait(30)
    assert storage.list_steps(url) == [2]
    assert torch.equal(storage.load_state_dict(url)["x"], state["x"])


def test_an_ftsdp_wrapper_inside_another_module_is_refused() -> None:
    """A parent module holding the wrapper would be saved as a plain module, its sharded
    optimizer state taken for a replica (wrong on resume): refused, naming what to pass."""
    import ftsdp

    wrapped = ftsdp.FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    parent = nn.ModuleDict({"net": wrapped, "head": nn.Linear(4, 2)})
    opt = torch.optim.AdamW(parent.parameters(), lr=1e-2)
    with pytest.raises(TypeError, match="pass the wrapper itself"):
        engine_for(parent, opt)
    assert type(engine_for(wrapped, torch.optim.AdamW(wrapped.parameters()))).__name__ == (
        "FtsdpEngine"
    )
