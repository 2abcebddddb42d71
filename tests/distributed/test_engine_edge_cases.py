"""Edge cases users hit, each against the unwrapped model, on one spawn of 4 gloo ranks.

Activation checkpointing (reentrant or not) inside and around units, parameters a forward
does not use, freezing after wrapping, a forward with no backward before an optimizer step,
outputs in a dataclass, in-place ops on a unit's input, rank-divergent freezing (refused at
wrap time), and deterministic mode: bitwise the same weights at world sizes 1, 2, 3 and 4
(sub-groups of the one spawn).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import ftsdp
from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups

WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-6)


class Inner(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.spare = nn.Linear(d, d)  # used only when ``use_spare``

    def forward(self, x: torch.Tensor, use_spare: bool = False, ckpt: str = "") -> torch.Tensor:
        h = torch.relu(x)  # in place below when asked: a unit modifying its input
        h = checkpoint(self.a, h, use_reentrant=(ckpt == "reentrant")) if ckpt else self.a(h)
        h = self.b(torch.tanh(h))
        return self.spare(h) if use_spare else h


@dataclasses.dataclass
class Out:
    value: torch.Tensor


class Net(nn.Module):
    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.units = nn.ModuleList(Inner() for _ in range(3))
        self.out = nn.Linear(6, 2)
        self.inplace = inplace

    def forward(self, x: torch.Tensor, mode: str = "") -> Out:
        h = self.inp(x)
        for i, unit in enumerate(self.units):
            if self.inplace:
                h = h * 1.0  # a fresh tensor the unit may modify in place
                torch.relu_(h)
            if mode.startswith("ckpt_around"):
                h = checkpoint(unit, h, use_reentrant=mode.endswith("reentrant"))
            else:
                ckpt = mode.removeprefix("ckpt_inside").strip("_") or "plain"
                ckpt = ckpt if mode.startswith("ckpt_inside") else ""
                h = unit(h, use_spare=(mode == "spare" and i != 1), ckpt=ckpt)
        return Out(self.out(h))


def train_pair(
    rank: int, mode: str, steps: int = 3, freeze_after: bool = False, inplace: bool = False
):
    """Train Net wrapped (FULL_SHARD, each Inner a unit) and unwrapped; compare."""
    torch.manual_seed(0)
    reference = Net(inplace=inplace)
    wrapped = ftsdp.FSDP(copy.deepcopy(reference), auto_wrap_policy={Inner})
    if freeze_after:
        for model in (reference, wrapped):
            for name, p in model.named_parameters():
                if name.startswith("units.0.") or name == "out.bias":
                    p.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(param_groups(wrapped, 0.1), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-2, eps=1e-6)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(2 * WORLD, 5, generator=g)
        wrapped(x[2 * rank : 2 * rank + 2], mode).value.square().mean().backward()
        reference(x, mode).value.square().mean().backward()
        if mode == "spare":
            for name, p in wrapped.named_parameters():
                assert (p.grad is None) == name.startswith("units.1.spare"), (name, p.grad)
        if mode == "stale":  # a forward for metrics, no backward, before the step
            wrapped(x[:2]).value.sum()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = wrapped.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(full[key], value, **TOL, msg=lambda m, k=key: f"{mode}: {k} {m}")
    for name, before in frozen.items():
        assert torch.equal(full[name], before), f"{mode}: frozen {name} moved"
    x = torch.randn(3, 5, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x).value, reference(x).value, **TOL)
    assert wrapped.memory_stats()["unsharded_param_bytes"] == 0, mode


def check_rank_divergent_freezing(rank: int) -> None:
    torch.manual_seed(0)
    net = Net()
    if rank == 1:
        net.units[2].requires_grad_(False)
    try:
        ftsdp.FSDP(net, auto_wrap_policy={Inner})
    except ValueError as err:
        assert "differs across ranks" in str(err), err
    else:
        raise AssertionError("rank-divergent requires_grad was accepted (it would hang)")


MICRO = 2
# 5: uneven shares at world sizes 2, 3 and 4 (the shorter ranks pad); 3 at 4: a rank with no
# micro-batch at all, only a padding pass.
MICROBATCHES = (5, 3)


def deterministic_run(
    rank: int, group: dist.ProcessGroup, n: int, hybrid: tuple | None = None
) -> dict[str, torch.Tensor]:
    """4 steps of GPT in deterministic mode on ``group``, ``n`` micro-batches each; rank r runs
    the r-th contiguous block (sizes differing by at most one), then padding passes up to the
    longest. ``hybrid``: HYBRID_SHARD over these (shard, replicate) groups instead."""
    world = dist.get_world_size(group)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=16))
    layout: dict = {"process_group": group}
    if hybrid is not None:
        layout = {"process_group": hybrid, "sharding_strategy": "HYBRID_SHARD"}
    wrapped = ftsdp.FSDP(model, auto_wrap_policy={Block}, deterministic=True, **layout)
    opt = torch.optim.AdamW(param_groups(wrapped, 0.1), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    base, extra = divmod(n, world)
    passes = base + (extra > 0)
    start = rank * base + min(rank, extra)
    for _ in range(4):
        tokens = torch.randint(0, 23, (n, MICRO, 9), generator=g)
        mine = list(tokens[start : start + base + (rank < extra)])
        pads = passes - len(mine)
        # A padding pass (one sample, its loss scaled up) must add nothing.
        for i, micro in enumerate(mine + [tokens[0, :1]] * pads):
            with (
                wrapped.no_sync() if i < passes - 1 else contextlib.nullcontext(),
                wrapped.padding() if i >= len(mine) else contextlib.nullcontext(),
            ):
                loss = wrapped(micro[:, :-1], micro[:, 1:])[1]
                (loss * (1e6 if i >= len(mine) else 1.0)).backward()  # no 1/accum: it averages
        wrapped.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    return wrapped.state_dict()


def check_deterministic_across_world_sizes(rank: int) -> None:
    single = {}
    for n in MICROBATCHES:
        results = {}
        for size in (1, 2, 3, 4):
            group = dist.new_group(list(range(size)))  # every rank must create every group
            if rank < size:
                results[size] = deterministic_run(rank, group, n)
            dist.barrier()
        single[n] = results.get(1)
        if rank == 0:
            for size in (2, 3, 4):
                for key, value in results[1].items():
                    assert torch.equal(results[size][key], value), (
                        f"{n} micro-batches, W={size}: {key}"
                    )
    # HYBRID over shard groups that are not runs of consecutive ranks ({0, 2} and {1, 3}, as a
    # (replicate, shard) mesh [[0, 2], [1, 3]] makes): its gather yields the ranks' rows in
    # another order than theirs (0, 2, 1, 3), which summed them in that order (3.7e-8 off).
    shards = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replicas = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    hybrid = deterministic_run(rank, dist.group.WORLD, 5, (shards[rank % 2], replicas[rank // 2]))
    if rank == 0:
        for key, value in single[5].items():
            assert torch.equal(hybrid[key], value), f"HYBRID on [[0, 2], [1, 3]]: {key}"


def edge_cases(rank: int, world: int) -> int:
    torch.set_num_threads(1)  # deterministic mode's contract (CPU reductions vary with threads)
    checks = [
        lambda: train_pair(rank, "plain"),
        lambda: train_pair(rank, "ckpt_inside"),
        lambda: train_pair(rank, "ckpt_around"),
        lambda: train_pair(rank, "ckpt_inside_reentrant"),
        lambda: train_pair(rank, "ckpt_around_reentrant"),
        lambda: train_pair(rank, "spare"),
        lambda: train_pair(rank, "stale"),
        lambda: train_pair(rank, "plain", freeze_after=True),
        lambda: train_pair(rank, "plain", inplace=True),
        lambda: check_rank_divergent_freezing(rank),
        lambda: check_deterministic_across_world_sizes(rank),
    ]
    for check in checks:
        check()
        dist.barrier()
    return len(checks)


@pytest.mark.timeout(600)
def test_engine_edge_cases(spawns) -> None:
    assert spawns.result(WORLD, "test_engine_edge_cases.edge_cases") == [11] * WORLD
