"""Checkpoints of state on one GPU: storage's copy into pinned host memory after the work queued
on the caller's stream, CheckpointManager's deferred copy and its fence, the persister's copy
into shared memory, the memory tier, resumes and loads onto the device, and torch FSDP2 on
NCCL. Skipped where there is no GPU (``bash tools/gpu_check.sh`` runs them on one).

The reference is always the state itself, cloned on the device at the moment of the save.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager
from ftsdp.storage.saving import _save

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

WIDTH = 1024  # 4 MiB per weight: copies long enough for a missing fence to show


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def slow_on_device(x: torch.Tensor, rounds: int = 40) -> torch.Tensor:
    """``x`` again, computed by a chain of matrix products queued on the current stream that
    takes the GPU a while: a copy that does not wait for the queued work reads old values."""
    m = torch.eye(x.shape[-1], device=x.device, dtype=x.dtype)
    y = x
    for _ in range(rounds):
        y = y @ m
    return y


def _state() -> dict[str, Any]:
    g = torch.Generator(device=device()).manual_seed(0)
    d = device()
    return {
        "w": torch.randn(WIDTH, WIDTH, device=d, generator=g),
        "bf16": torch.randn(257, 33, device=d, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000, device=d, dtype=torch.int64) * 3,
        "mask": torch.rand(100, device=d, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, device=d),
        "empty": torch.empty(0, 4, device=d),
        "transposed": torch.randn(64, 48, device=d, generator=g).t(),  # not contiguous
        "host": torch.randn(10),
    }


def _clones(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].cpu(), v.cpu()), k


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_copies_the_values_queued_before_it_and_not_the_changes_after(
    tmp_path: pathlib.Path, async_save: bool
) -> None:
    """``w`` is still being computed on the GPU when ``save`` is called, and zeroed right after
    it returns: the checkpoint holds the computed values (the copy waited for the queued work
    and was done, on a side stream, before ``save`` returned)."""
    state = _state()
    state["w"] = slow_on_device(state["w"])
    want = _clones(state)  # queued after the products: the values the save must see
    url = str(tmp_path / "ckpt")
    handle = storage.save(state, url, 1, async_save=async_save)
    for v in state.values():
        v.zero_()
    handle.wait()
    _assert_equal(storage.load_state_dict(url), want)


def test_loads_onto_the_device_equal_the_saved_tensors(tmp_path: pathlib.Path) -> None:
    state = _state()
    want = _clones(state)
    url = str(tmp_path / "ckpt")
    storage.save(state, url, 3).wait()
    on_device = storage.load_state_dict(url, device=device())
    assert all(v.device == device() for v in on_device.values())
    _assert_equal(on_device, want)
    targets = {k: torch.full_like(v, 7) for k, v in want.items()}  # the device each one has
    storage.load(targets, url)
    assert targets["w"].device == device() and targets["host"].device.type == "cpu"
    _assert_equal(targets, want)
    lazy = storage.LazyStateDict(url)
    assert torch.equal(lazy["w"].to(device()), want["w"])


# -- CheckpointManager ---------------------------------------------------------------------------


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).to(device())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator(device=device()).manual_seed(step)
    x = torch.randn(64, WIDTH, device=device(), generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _moment(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's and AdamW's tensors, cloned now (queued on the stream: exact at this point)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, s in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{names[id(p)]}.{key}"] = s[key].clone()
    return out


def _check_saved(url: str, step: int, want: dict[str, torch.Tensor]) -> None:
    saved = storage.load_state_dict(url, step)
    for k, v in want.items():
        assert torch.equal(saved[k], v.cpu()), (step, k)


@pytest.fixture
def slow_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every deferred snapshot copy starts 0.2 s late: an optimizer step that did not wait for
    it would change what it copies."""
    real = _save.copy_into

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(_save, "copy_into", late)


@pytest.mark.parametrize(
    "mode", ["deferred", "staged", "persister", "persister-staged", "blocking"]
)
def test_every_save_holds_the_state_of_its_step_while_training_goes_on(
    tmp_path: pathlib.Path, slow_copies: None, mode: str
) -> None:
    """Saves every 2 steps of a model and AdamW on the GPU, training on at once after each: every
    kept step loads equal to the state cloned at its save."""
    model, opt = _model(0)
    kwargs: dict[str, Any] = {
        "deferred": {},
        "staged": {"defer_copy": False},
        "persister": {"persister": True},
        "persister-staged": {"persister": True, "defer_copy": False},
        "blocking": {"async_save": False},
    }[mode]
    url = str(tmp_path / "ckpt")
    ckpt = CheckpointManager(url, model, opt, keep_last=None, **kwargs)
    assert ckpt.resume({"step": 0}) is None
    moments = {}
    for step in range(1, 9):
        _train(model, opt, step)
        if step % 2 == 0:
            moments[step] = _moment(model, opt)
            ckpt.save(step, {"step": step})
    if mode.startswith("persister"):  # the slots page-locked: the device copies into them
        assert ckpt._snap is not None and len(ckpt._snap.pinned) == len(ckpt._snap.maps) > 0
    ckpt.close()
    assert storage.list_steps(url) == sorted(moments)
    for step, want in moments.items():
        _check_saved(url, step, want)


def test_a_resume_puts_the_saved_state_back_on_the_device_and_training_follows(
    tmp_path: pathlib.Path, shm_path: pathlib.Path
) -> None:
    """Durable saves at steps 2 and 4, memory snapshots at every step, then the loop fails: a
    fresh model resumes from the memory tier's step 5 on the GPU, bitwise, and its next step
    equals the uninterrupted run's."""
    model, opt = _model(0)
    url, memory = str(tmp_path / "ckpt"), str(shm_path / "tier")
    with (
        pytest.raises(RuntimeError, match="the loop failed"),
        CheckpointManager(
            url, model, opt, every_steps=2, memory_url=memory, memory_every=1
        ) as ckpt,
    ):
        ckpt.resume({"step": 0})
        for step in range(1, 6):
            _train(model, opt, step)
            if ckpt.due(step):
                ckpt.save(step, {"step": step})
            ckpt.save_to_memory(step, {"step": step})
        ckpt.wait()
        raise RuntimeError("the loop failed")
    assert storage.list_steps(url) == [2, 4]
    at_5 = _moment(model, opt)
    _train(model, opt, 6)
    uninterrupted = _moment(model, opt)

    other, other_opt = _model(1)
    trainer: dict[str, Any] = {"step": 0}
    with CheckpointManager(url, other, other_opt, every_steps=2, memory_url=memory) as again:
        info = again.resume(trainer)
        assert info is not None and info.step == 5 and trainer["step"] == 5
        assert again.resumed_from == memory
        got = _moment(other, other_opt)
        assert all(v.device == device() for v in got.values())
        for k, v in at_5.items():
            assert torch.equal(got[k], v), k
        _train(other, other_opt, 6)
        for k, v in _moment(other, other_opt).items():
            assert torch.equal(v, uninterrupted[k]), k


# -- the engines on the device ---------------------------------------------------------------------


@pytest.mark.parametrize("offload", [False, True])
def test_ftsdp_on_the_device_resumes_bitwise(tmp_path: pathlib.Path, offload: bool) -> None:
    """``ftsdp.FSDP`` (one GPU; with CPU offload: pinned host shards) saved at step 2 while
    training to step 4; a fresh wrapped model resumes step 2 exactly."""
    import ftsdp
    from ftsdp.examples.gpt import GPT, Block, GPTConfig

    def wrapped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=128))
        offloading = ftsdp.CPUOffload(offload_params=True) if offload else None
        model = ftsdp.FSDP(
            net, auto_wrap_policy={Block}, device_id=device(), cpu_offload=offloading
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        g = torch.Generator().manual_seed(i)
        t = torch.randint(0, 64, (4, 17), generator=g).to(device())
        model(t[:, :-1], t[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    model, opt = wrapped(0)
    url = str(tmp_path / "ckpt")
    ckpt = CheckpointManager(url, model, opt)
    ckpt.resume({"step": 0})
    for i in (1, 2):
        step(model, opt, i)
    want = full(model)
    ckpt.save(2, {"step": 2})
    for i in (3, 4):
        step(model, opt, i)
    ckpt.close()

    other, other_opt = wrapped(1)
    again = CheckpointManager(url, other, other_opt)
    info = again.resume({"step": 0})
    assert info is not None and info.step == 2
    got = full(other)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    step(other, other_opt, 3)  # the resumed optimizer state is usable on the device
    again.close()


def _fsdp2_rank(rank: int, world: int, url: str) -> dict[str, Any]:
    """One NCCL rank: FSDP2 on the GPU saved by CheckpointManager at step 2 while training to
    step 3, then resumed into a fresh FSDP2 model; the full tensors compared on the host."""
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(rank)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)]).cuda()
        for layer in net:
            fully_shard(layer)
        fully_shard(net)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(i)
        model(torch.randn(8, 256, device="cuda", generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}

    model, opt = build(0)
    ckpt = CheckpointManager(url, model, opt)
    ckpt.resume({"step": 0})
    step(model, opt, 1)
    step(model, opt, 2)
    want = full(model)
    ckpt.save(2, {"step": 2})
    step(model, opt, 3)
    ckpt.close()
    other, other_opt = build(1)
    again = CheckpointManager(url, other, other_opt)
    info = again.resume({"step": 0})
    got = full(other)
    step(other, other_opt, 3)
    again.close()
    return {
        "step": None if info is None else info.step,
        "equal": sorted(k for k in want if torch.equal(got[k], want[k])),
        "names": sorted(want),
    }


def test_fsdp2_on_nccl_resumes_bitwise(tmp_path: pathlib.Path) -> None:
    from ftsdp.testing import run_ranks

    (out,) = run_ranks(_fsdp2_rank, 1, str(tmp_path / "ckpt"), backend="nccl", timeout=240)
    assert out["step"] == 2
    assert out["equal"] == out["names"] and out["names"]
