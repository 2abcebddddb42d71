"""CheckpointManager with other engines and optimizers: saved at world size 2, resumed at 3.

A grid of tiny models runs inside one spawn per world size: torch FSDP2 (``fully_shard``, uneven
``Shard(0)`` chunks, an empty one at W=3) with AdamW, SGD with momentum and Adagrad; DDP; and
``ftsdp.FSDP`` with SGD with momentum. The references are torch's own: the full state gathered by
``torch.distributed.checkpoint.state_dict.get_state_dict(full_state_dict=True)`` (FSDP2, DDP) or
the engine's full ``state_dict()`` and its gathered optimizer shards (ftsdp), and an unwrapped
model in this process that loaded the saved full state with ``set_state_dict``.

- The checkpoint holds exactly the state the W=2 ranks had when they saved (bitwise).
- Right after the resume at W=3 the full state is that state again (bitwise), hyper-parameters
  changed after construction included.
- The next step at W=3 equals the unwrapped reference's step from the same state (the math of
  a sharded step differs only in summation order: within 1e-6).
- FSDP2 with AdamW also saves asynchronously with ``keep_last=2``; its newest step is corrupted
  before the resume, which falls back to the previous one and then saves at W=3 again.
- The names are the unwrapped model's, so the FSDP2 and DDP checkpoints also resume into a plain
  module in this process (bitwise).

The W=2 grid and the W=3 grid run in the spawns this module shares with
``test_checkpoint_manager.py`` (``spawns`` in this folder's conftest.py).
"""

from __future__ import annotations

import json
import pathlib
import random
import shutil

import numpy as np
import pytest
import torch

from ftsdp import storage

pytestmark = pytest.mark.timeout(600)  # the first test runs the shared spawns (conftest.py)
GLOBAL = 12  # samples per step, split evenly over the ranks
CASES = {  # name: (engine, optimizer, steps saved)
    "fsdp2-adamw": ("fsdp2", "adamw", [1, 2, 3]),  # async, keep_last=2, fallback at W=3
    "fsdp2-sgd": ("fsdp2", "sgd", [2]),
    "fsdp2-adagrad": ("fsdp2", "adagrad", [2]),
    "ddp-sgd": ("ddp", "sgd", [2]),
    "ftsdp-sgd": ("ftsdp", "sgd", [2]),
}
CHANGED_LR = 0.0123  # set on group 0 after construction: must come back from the checkpoint


class Net(torch.nn.Module):
    """Dimensions 7, 5 and 2: Shard(0) is uneven at W=2 and W=3, and the head's rank-2 chunk at
    W=3 is empty."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.head = (
            torch.nn.Linear(8, 7),
            torch.nn.Linear(7, 5),
            torch.nn.Linear(5, 2),
        )
        self.register_buffer("scale", torch.tensor([1.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x))))) * self.scale


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.Adagrad(groups, lr=0.05)


def _build(engine: str, opt_name: str, seed: int):
    torch.manual_seed(seed)
    net = Net()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(net.l1)
        fully_shard(net.l2)
        model = fully_shard(net)
    elif engine == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(net)
    elif engine == "ftsdp":
        import ftsdp

        model = ftsdp.FSDP(net, auto_wrap_policy={torch.nn.Linear})
    else:
        model = net
    return model, _optimizer(opt_name, model)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL, 8, generator=torch.Generator().manual_seed(1000 + step))


def _step(model, opt, rank: int, world: int, step: int) -> None:
    x = _batch(step)[rank * GLOBAL // world : (rank + 1) * GLOBAL // world]
    model(x).square().mean().backward()  # every engine averages over the ranks
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(engine: str, model, opt) -> dict[str, np.ndarray]:
    """The full state under the checkpoint's names, gathered the engine's own way (collective)."""
    import torch.distributed as dist

    out: dict[str, np.ndarray] = {}
    if engine == "ftsdp":
        for k, v in model.state_dict().items():
            out[f"model.{k}"] = v.numpy().copy()
        sd = model.sharded_optim_state_dict(opt)
        mine = {
            f"optim.state.{n}.{k}": (v.offset, v.local.numpy().copy(), v.global_shape)
            if hasattr(v, "global_shape")
            else (None, v.numpy().copy(), None)
            for n, entry in sd["state"].items()
            for k, v in entry.items()
        }
        pieces: list = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, mine)
        for name, (offset, value, shape) in mine.items():
            if offset is None:
                out[name] = value
                continue
            flat = np.zeros(int(np.prod(shape)), dtype=value.dtype)
            for rank_pieces in pieces:
                off, local, _ = rank_pieces[name]
                flat[off : off + local.size] = local
            out[name] = flat.reshape(shape)
        return out
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out.update({f"model.{k}": v.detach().numpy().copy() for k, v in msd.items()})
    for name, entry in osd["state"].items():
        for k, v in entry.items():
            out[f"optim.state.{name}.{k}"] = v.detach().numpy().copy()
    return out


def _groups(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _save_grid(rank: int, world: int, root: str) -> dict:
    from ftsdp.checkpoint._manager import CheckpointManager

    out: dict = {}
    for case, (engine, opt_name, saves) in CASES.items():
        model, opt = _build(engine, opt_name, 0)
        opt.param_groups[0]["lr"] = CHANGED_LR
        ckpt = CheckpointManager(f"{root}/{case}", model, opt, keep_last=2)  # async saves
        assert ckpt.engine.kind == {"fsdp2": "dtensor"}.get(engine, engine)
        full = {}
        for step in range(1, max(saves) + 1):
            _step(model, opt, rank, world, step)
            if step in saves:
                ckpt.save(step, {"step": step})
                full[step] = _full(engine, model, opt)
        ckpt.close()
        out[case] = {"full": full, "groups": _groups(opt)}
    return out if rank == 0 else {}


def _resume_grid(rank: int, world: int, root: str) -> dict:
    from ftsdp.checkpoint._manager import CheckpointManager

    out: dict = {}
    for case, (engine, opt_name, _) in CASES.items():
        model, opt = _build(engine, opt_name, 1)  # another init: everything comes from the save
        ckpt = CheckpointManager(f"{root}/{case}", model, opt, keep_last=2, log=lambda _: None)
        trainer = {"step": 0}
        info = ckpt.resume(trainer)
        resumed = {
            "step": info.step,
            "saved_world_size": info.saved_world_size,
            "skipped": [s for s, _ in info.skipped],
            "trainer": dict(trainer),
            "full": _full(engine, model, opt),
            "groups": _groups(opt),
        }
        _step(model, opt, rank, world, info.step + 1)
        resumed["after_step"] = _full(engine, model, opt)
        ckpt.save(info.step + 1, {"step": info.step + 1})  # after a fallback: discards the newer
        ckpt.close()
        out[case] = resumed
    return out if rank == 0 else {}


def _damage_and_keep(root: pathlib.Path) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    """After the W=2 grid saved under ``root``, before the W=3 grid resumes: corrupt the newest
    step of fsdp2-adamw (its original returned) and keep a copy of ``root`` as saved."""
    run = root / "fsdp2-adamw"
    assert storage.list_steps(str(run)) == [2, 3]  # async saves, keep_last=2
    original_3 = storage.load_state_dict(str(run), 3)
    obj = max((run / "step-3").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(obj.read_bytes())
    data[-5] ^= 0xFF  # inside the payload: its checksum catches it
    obj.write_bytes(bytes(data))
    shutil.copytree(root, root.parent / "as_saved")  # before the W=3 run adds its saves
    return root.parent / "as_saved", original_3


@pytest.fixture(scope="module")
def runs(spawns):
    """_save_grid at W=2, _damage_and_keep, _resume_grid at W=3 (the shared spawns): the root,
    its copy as saved, rank 0's saved and resumed records, step 3 before the damage."""
    return spawns.engine_runs()


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        assert np.asarray(a[k]).shape == np.asarray(b[k]).shape, (what, k)
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), (what, k)


@pytest.mark.parametrize("case", list(CASES))
def test_saved_at_2_resumed_at_3_bitwise_then_one_step_like_unwrapped(runs, case) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    root, as_saved, saved, resumed, original_3 = runs
    _, opt_name, _ = CASES[case]
    url = str(as_saved / case)
    got = resumed[case]
    step = 2  # fsdp2-adamw: step 3 is corrupt, the resume fell back to 2
    assert got["step"] == step and got["saved_world_size"] == 2
    assert got["skipped"] == ([3] if case == "fsdp2-adamw" else [])
    assert got["trainer"] == {"step": step}

    # The checkpoint is the W=2 state when it saved; the W=3 state after resuming is that too.
    want = saved[case]["full"][step]
    on_disk = {k: v.numpy() for k, v in storage.load_state_dict(url, step).items()}
    _assert_equal(on_disk, want, "checkpoint vs saved state")
    _assert_equal(got["full"], want, "resumed at 3 vs saved at 2")
    assert got["groups"] == saved[case]["groups"] and got["groups"][0]["lr"] == CHANGED_LR
    assert any(".momentum_buffer" in k or ".exp_avg" in k or ".sum" in k for k in want)

    # One more step at W=3 is the unwrapped model's step from the same state.
    ref, ref_opt = _build("module", opt_name, 2)
    groups = storage.catalog.read_manifest(url, step).values["optim.param_groups"]
    osd: dict = {"state": {}, "param_groups": json.loads(groups)}
    for k, v in want.items():
        if k.startswith("optim.state."):
            name, key = k[len("optim.state.") :].rsplit(".", 1)
            osd["state"].setdefault(name, {})[key] = torch.from_numpy(v.copy())
    msd = {
        k[len("model.") :]: torch.from_numpy(v.copy())
        for k, v in want.items()
        if k.startswith("model.")
    }
    set_state_dict(ref, ref_opt, model_state_dict=msd, optim_state_dict=osd)
    _step(ref, ref_opt, 0, 1, step + 1)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(got["after_step"][f"model.{k}"], v.numpy(), rtol=1e-5, atol=1e-6)

    # The W=3 save of the next step holds the W=3 state (after the fallback: on one timeline).
    now = {k: v.numpy() for k, v in storage.load_state_dict(str(root / case), step + 1).items()}
    _assert_equal(now, got["after_step"], "saved at 3")
    assert storage.list_steps(str(root / case)) == [step, step + 1]
    if case == "fsdp2-adamw":  # the abandoned step 3 was replaced, not kept
        assert any(not torch.equal(torch.from_numpy(now[k]), original_3[k]) for k in now)
    assert storage.catalog.verify(str(root / case)).ok


@pytest.mark.parametrize("case", ["fsdp2-adagrad", "ddp-sgd"])
def test_a_sharded_or_ddp_checkpoint_resumes_into_a_plain_module(runs, case) -> None:
    from ftsdp.checkpoint._manager import CheckpointManager

    _, as_saved, saved, _, _ = runs
    _, opt_name, _ = CASES[case]
    model, opt = _build("module", opt_name, 3)
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:  # another world size: the manager reseeds this process's RNGs
        info = CheckpointManager(str(as_saved / case), model, opt).resume({"step": 0})
    finally:
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
    assert info.step == 2 and info.saved_world_size == 2
    full = {f"model.{k}": v.numpy() for k, v in model.state_dict().items()}
    params = dict(zip((n for n, _ in model.named_parameters()), model.parameters(), strict=True))
    for name, p in params.items():
        for key, value in opt.state[p].items():
            full[f"optim.state.{name}.{key}"] = value.numpy()
    _assert_equal(full, saved[case]["full"][2], "plain module vs saved at 2")
