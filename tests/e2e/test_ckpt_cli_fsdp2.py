"""A DCP checkpoint written by torch FSDP2 (``fully_shard``) at world size 2 converts with
``ftsdp-ckpt convert --to ftsdp`` and loads into the ftsdp engine at world size 3, which then
trains on with the same losses as FSDP2 continuing from the same point (AdamW, so the optimizer
state crosses over too). One spawn of 3 ranks: FSDP2 runs on a 2-rank subgroup."""

from __future__ import annotations

import pathlib

import pytest
import torch

from ftsdp.testing import run_ranks

CONFIG = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
GLOBAL_BATCH = 6  # divisible by 2 and 3
STEPS_BEFORE, STEPS_AFTER = 3, 3
LR = 3e-3


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CONFIG["vocab_size"], (GLOBAL_BATCH, CONFIG["block_size"]), generator=g)
    y = torch.roll(x, -1, dims=1)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _step(model, opt, step: int, rank: int, world: int, group=None) -> float:
    import torch.distributed as dist

    x, y = _batch(step, rank, world)
    loss = model(x, y)[1]
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total) / world


def _fsdp2(rank: int, world: int, url: str, group) -> list[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from ftsdp.examples.gpt import GPT, Block, GPTConfig

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    for m in model.modules():
        if isinstance(m, Block):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS_BEFORE):
        _step(model, opt, step, rank, world, group)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=url, process_group=group)
    return [_step(model, opt, STEPS_BEFORE + i, rank, world, group) for i in range(STEPS_AFTER)]


def _both(rank: int, world: int, tmp: str) -> tuple[list[float], list[float]]:
    """FSDP2 on ranks 0 and 1 (rank 2 waits), the conversion on rank 0, ftsdp on all three."""
    import torch.distributed as dist

    from ftsdp.tools.ckpt import main

    group = dist.new_group([0, 1])
    expected = _fsdp2(rank, 2, f"{tmp}/fsdp2-dcp", group) if rank < 2 else []
    dist.barrier()
    if rank == 0:
        assert main(["convert", f"{tmp}/fsdp2-dcp", f"{tmp}/ftsdp", "--to", "ftsdp", "-q"]) == 0
    dist.barrier()
    return expected, _ftsdp(rank, world, f"{tmp}/ftsdp")


def _ftsdp(rank: int, world: int, url: str) -> list[float]:
    import ftsdp
    from ftsdp import storage
    from ftsdp.examples.gpt import GPT, Block, GPTConfig

    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = ftsdp.FSDP(GPT(GPTConfig(**CONFIG)), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for p in model.parameters():  # AdamW creates its state lazily; make it exist to load into
        opt.state[p] = {
            "step": torch.tensor(0.0),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }

    def shard(view):
        return storage.FlatShard(view.global_shape, view.offset, view.local)

    optim = model.sharded_optim_state_dict(opt)
    target = {
        "model": {n: shard(v) for n, v in model.sharded_state_dict().items()},
        "optim": {
            "state": {
                name: {
                    k: shard(v) if isinstance(v, ftsdp.fsdp.ShardView) else v
                    for k, v in entry.items()
                }
                for name, entry in optim["state"].items()
            }
        },
    }
    result = storage.load(target, url, strict=False)
    assert not result.missing and not result.mismatched, (result.missing, result.mismatched)
    assert result.saved_world_size == 1
    return [_step(model, opt, STEPS_BEFORE + i, rank, world) for i in range(STEPS_AFTER)]


@pytest.mark.timeout(240)
def test_fsdp2_dcp_converts_and_trains_on_in_ftsdp(tmp_path: pathlib.Path) -> None:
    expected, got = run_ranks(_both, 3, str(tmp_path), start_method="forkserver")[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-4)
