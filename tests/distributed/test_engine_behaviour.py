"""Engine behaviour beyond parity, on real gloo ranks (one spawn at world size 3: padding).

- a model that differs across ranks is refused at wrap time on every rank (no hang later);
- ``sync_module_states`` makes every rank start from rank 0's weights;
- ``no_sync`` really skips gradient communication, and the bytes a step moves are exactly one
  all-gather per unit for forward, one more per non-root unit for backward (the root stays
  unsharded), and one reduce-scatter per unit — i.e. 3·psi·(W−1)/W minus the root's re-gather;
- several forwards before one backward, and a unit whose parameters go unused, still train
  like the unsharded model;
- the flat collectives (gloo: broadcasts for the all-gather, an in-place all-reduce for a
  reduce-scatter that may consume its input) give exactly their definitions.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ftsdp
from ftsdp.examples.gpt import GPT, Block, GPTConfig

WORLD = 3


def gpt(seed: int = 0, n_embd: int = 16) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=n_embd))


def data(rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 29, (2 * WORLD, 9), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def check_mismatch_refused(rank: int) -> None:
    model = gpt(n_embd=16 if rank != 1 else 8)
    try:
        ftsdp.FSDP(model, auto_wrap_policy={Block})
    except ValueError as err:
        assert "differs across ranks" in str(err) and "rank 1 has" in str(err), err
    else:
        raise AssertionError("a model that differs on rank 1 was accepted")


def check_sync_module_states(rank: int) -> None:
    wrapped = ftsdp.FSDP(gpt(seed=rank), auto_wrap_policy={Block}, sync_module_states=True)
    expected = gpt(seed=0).state_dict()
    for key, value in wrapped.state_dict().items():
        assert torch.equal(value, expected[key]), f"rank {rank}: {key} not rank 0's"


def check_communication(rank: int) -> None:
    bytes_per = 4 * (WORLD - 1)  # fp32, per rank, per element of a shard
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        wrapped = ftsdp.FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy={Block})
        units = wrapped.units()
        x, y = data(rank)
        stats = wrapped.comm_stats
        stats.reset()
        with wrapped.no_sync():
            wrapped(x, y)[1].backward()
        assert "reduce_scatter" not in stats.calls and "all_reduce" not in stats.calls, (
            strategy,
            dict(stats.calls),
        )
        stats.reset()
        wrapped(x, y)[1].backward()
        shards = [u["shard_numel"] for u in units]
        psi = sum(u["numel"] for u in units)
        if strategy == "NO_SHARD":
            assert dict(stats.calls) == {"all_reduce": len(units)}, dict(stats.calls)
            expected = sum(2 * (WORLD - 1) * 4 * u["padded_numel"] // WORLD for u in units)
            assert stats.bytes["all_reduce"] == expected
            continue
        gathers = shards[0] + sum(shards[1:]) * (2 if strategy == "FULL_SHARD" else 1)
        assert stats.bytes["all_gather"] == bytes_per * gathers, (strategy, dict(stats.bytes))
        assert stats.bytes["reduce_scatter"] == bytes_per * sum(shards), strategy
        if strategy == "FULL_SHARD":  # theory: 3·psi·(W−1)/W elements, less the root's re-gather
            theory = 3 * psi * (WORLD - 1) / WORLD * 4
            padding = 3 * bytes_per * len(units)
            saved = bytes_per * shards[0]
            assert abs(stats.total_bytes() + saved - theory) <= padding, (
                stats.total_bytes(),
                theory,
            )


class TwoHeads(nn.Module):
    """A unit whose second head is unused, and a model run twice before one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(7, 11), nn.Tanh())
        self.used = nn.Linear(11, 3)
        self.unused = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(self.trunk(x))


def check_two_forwards_and_unused(rank: int) -> None:
    torch.manual_seed(5)
    reference = TwoHeads()
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={nn.Sequential, nn.Linear})
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        a, b = torch.randn(2 * WORLD, 7, generator=g), torch.randn(2 * WORLD, 7, generator=g)
        mine = slice(2 * rank, 2 * rank + 2)
        (wrapped(a[mine]).square().mean() + wrapped(b[mine]).pow(3).mean()).backward()
        (reference(a).square().mean() + reference(b).pow(3).mean()).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(wrapped.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    assert wrapped.memory_stats()["unsharded_param_bytes"] == 0


def check_collectives(rank: int) -> None:
    """The flat collectives against their definitions, sync and async, on gloo (where the
    all-gather is broadcasts and a consuming reduce-scatter is an in-place all-reduce)."""
    from ftsdp.fsdp._collectives import all_gather_flat, reduce_scatter_flat

    group = dist.group.WORLD
    for n, dtype in ((5, torch.float32), (1, torch.float32), (4, torch.bfloat16)):
        shards = [torch.arange(n, dtype=dtype) + 10 * r for r in range(WORLD)]
        for async_op in (False, True):
            out = torch.full((WORLD * n,), -1.0, dtype=dtype)
            work = all_gather_flat(out, shards[rank].clone(), group, async_op=async_op)
            if work is not None:
                work.wait()
            assert torch.equal(out, torch.cat(shards)), (n, dtype, async_op, out)
        fulls = [torch.arange(WORLD * n, dtype=dtype) * (r + 1) for r in range(WORLD)]
        expected = sum(fulls)[rank * n : (rank + 1) * n]
        for consume in (False, True):
            for async_op in (False, True):
                mine = fulls[rank].clone()
                out = torch.empty(n, dtype=dtype)
                work = reduce_scatter_flat(
                    out, mine, group, async_op=async_op, consume_input=consume
                )
                if work is not None:
                    work.wait()
                assert torch.equal(out, expected), (n, dtype, consume, async_op, out)
                if not consume:
                    assert torch.equal(mine, fulls[rank])  # the input is left alone


def behaviour(rank: int, world: int) -> list[str]:
    done = []
    for check in (
        check_collectives,
        check_mismatch_refused,
        check_sync_module_states,
        check_communication,
        check_two_forwards_and_unused,
    ):
        check(rank)
        dist.barrier()
        done.append(check.__name__)
    return done


@pytest.mark.timeout(600)
def test_engine_behaviour(spawns) -> None:
    results = spawns.result(WORLD, "test_engine_behaviour.behaviour")  # behaviour at W=3
    assert all(len(r) == 5 for r in results), results
