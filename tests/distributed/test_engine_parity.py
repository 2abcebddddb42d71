"""ftsdp training matches unsharded single-process training, at world sizes 1-4.

Each world size spawns its ranks once (W=2-4: the spawns this folder's modules share, see
conftest.py); inside, every rank runs the whole grid (model x sharding strategy x wrapping x
accumulation/clipping) and compares, step by step, against the unwrapped model trained on the
full global batch in the same process (same seed): per-step losses, the clip norm, and the final
full parameters (fp32, within 1e-5).
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ftsdp
from ftsdp.examples.gpt import GPT, MLP, Block, GPTConfig, param_groups
from ftsdp.testing import run_ranks

GLOBAL_BATCH = 24  # divisible by 2 * world size for 1..4: two micro-batches per rank
SEQ = 8
STEPS = 3  # Adam moments after two updates already tell a wrong shard or reduction
TOL = dict(rtol=1e-5, atol=1e-5)
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


class Layer(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class MLPNet(nn.Module):
    """An MLP with odd sizes, so flat parameters need padding at world size 3 and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(Layer(13, 29), nn.Sequential(Layer(29, 31), Layer(31, 17)))
        self.out = nn.Linear(17, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.out(self.layers(x))
        return pred, nn.functional.mse_loss(pred, y)


def build(kind: str) -> tuple[nn.Module, dict]:
    """A model of ``kind`` and its wrap policies; identical on every rank (fixed seed)."""
    torch.manual_seed(1234)
    if kind == "mlp":
        return MLPNet(), {"flat": None, "units": {Layer}, "nested": {Layer, nn.Sequential}}
    config = GPTConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config)
    if kind == "gpt_frozen":
        # Frozen parameters inside a trainable unit, and (nested wrapping) a unit that is
        # frozen whole: its backward still needs its weights for the input gradient.
        frozen = (
            model.wpe.weight,
            *model.blocks[0].ln_1.parameters(),
            *model.blocks[1].mlp.parameters(),
        )
        for p in frozen:
            p.requires_grad_(False)
    return model, {"flat": None, "units": {Block}, "nested": {Block, MLP}}


def batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    out = []
    for _ in range(STEPS):
        if kind == "mlp":
            out.append(
                (
                    torch.randn(GLOBAL_BATCH, 13, generator=g),
                    torch.randn(GLOBAL_BATCH, 5, generator=g),
                )
            )
        else:
            tokens = torch.randint(0, 37, (GLOBAL_BATCH, SEQ + 1), generator=g)
            out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Two param groups (no decay on biases and norm weights). eps=1e-6: a gradient that sums
    # to ~0 carries rounding noise near Adam's default eps (1e-8), which would turn the
    # harmless reordering of sums across ranks into 1e-4-sized update differences.
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-3, eps=1e-6)


def local_slice(tensor: torch.Tensor, view: ftsdp.fsdp.ShardView) -> torch.Tensor:
    return tensor.reshape(-1)[view.offset : view.offset + view.length]


def train_in_lockstep(kind, strategy, wrap, mode, rank, world, label) -> None:
    """Train the wrapped model (local data) and the reference (global batch) side by side."""
    micro, clip = (2, True) if mode == "accum_clip" else (1, False)
    reference, policies = build(kind)
    model, _ = build(kind)
    wrapped = ftsdp.FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policies[wrap])
    names = [n for n, _ in reference.named_parameters()]
    assert [n for n, _ in wrapped.named_parameters()] == names, label
    if strategy == "FULL_SHARD":
        check_memory(wrapped, world)
    frozen = {n: p.detach().clone() for n, p in reference.named_parameters() if not p.requires_grad}
    opt, ref_opt = make_optimizer(wrapped), make_optimizer(reference)
    views = wrapped.sharded_state_dict()
    ref_params, params = dict(reference.named_parameters()), dict(wrapped.named_parameters())
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step, (x, y) in enumerate(batches(kind)):
        _, ref_loss = reference(x, y)
        ref_loss.backward()
        total = torch.zeros(())
        for i, (xs, ys) in enumerate(zip(x[mine].chunk(micro), y[mine].chunk(micro), strict=True)):
            with wrapped.no_sync() if i < micro - 1 else contextlib.nullcontext():
                _, loss = wrapped(xs, ys)
                (loss / micro).backward()
            total += loss.detach() / micro
        dist.all_reduce(total)
        where = f"{label} step {step}"
        torch.testing.assert_close(
            total / world, ref_loss.detach(), **TOL, msg=lambda m: f"{where}: loss {m}"
        )
        for name in names:
            ref_grad = ref_params[name].grad
            if ref_grad is None:
                assert params[name].grad is None, f"{where}: {name} got a gradient"
                continue
            torch.testing.assert_close(
                params[name].grad,
                local_slice(ref_grad, views[name]),
                **TOL,
                msg=lambda m, n=name: f"{where}: grad of {n} {m}",
            )
        if strategy == "FULL_SHARD" and step == 0:
            stats = wrapped.memory_stats()
            assert stats["unsharded_param_bytes"] == 0, (where, stats)
            trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
            grad_bytes = sum(  # one sharded gradient per unit that has a trainable parameter
                4 * u["shard_numel"] for u in wrapped.units() if trainable & set(u["params"])
            )
            assert stats["sharded_grad_bytes"] == grad_bytes, (where, stats)
        if clip:
            norm = wrapped.clip_grad_norm_(0.05)
            ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m: f"{where}: norm {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of clearing must work
        ref_opt.zero_grad()
    full, expected = wrapped.state_dict(), reference.state_dict()
    assert list(full) == list(expected), label
    for key, value in expected.items():
        torch.testing.assert_close(
            full[key], value, **TOL, msg=lambda m, k=key: f"{label}: {k} {m}"
        )
    for name, before in frozen.items():
        assert torch.equal(full[name], before), f"{label}: frozen {name} changed"
    if strategy == "FULL_SHARD":
        check_memory(wrapped, world)
    check_optimizer_views(wrapped, opt, reference, ref_opt, label)


def check_memory(wrapped: ftsdp.FSDP, world: int) -> None:
    """Storage per unit is ceil(numel / W) after wrapping; nothing unsharded stays allocated."""
    for unit in wrapped.units():
        assert unit["shard_numel"] == -(-unit["numel"] // world), unit
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in wrapped.parameters()
    }
    expected = sum(u["shard_numel"] * 4 for u in wrapped.units() if u["numel"])
    assert sum(storages.values()) == expected, (storages, expected)
    assert wrapped.memory_stats()["unsharded_param_bytes"] == 0


def check_optimizer_views(wrapped, opt, reference, ref_opt, label: str) -> None:
    """Each rank's exp_avg / exp_avg_sq ranges equal the unsharded optimizer's, and the ranks'
    ranges together cover every element exactly once."""
    views = wrapped.sharded_optim_state_dict(opt)
    ref_params = dict(reference.named_parameters())
    expected_groups = [
        [n for n, p in reference.named_parameters() if any(p is q for q in group["params"])]
        for group in ref_opt.param_groups
    ]
    assert [g["params"] for g in views["param_groups"]] == expected_groups, label
    covered = torch.zeros(2, dtype=torch.int64)
    for name, entry in views["state"].items():
        assert entry["step"].dim() == 0 and int(entry["step"]) == STEPS, (label, name)
        for i, key in enumerate(("exp_avg", "exp_avg_sq")):
            view = entry[key]
            expected = ref_opt.state[ref_params[name]][key]
            assert view.global_shape == tuple(expected.shape), (label, name, key)
            torch.testing.assert_close(
                view.local,
                local_slice(expected, view),
                **TOL,
                msg=lambda m, n=name, k=key: f"{label}: {n}.{k} {m}",
            )
            covered[i] += view.length
    dist.all_reduce(covered)
    numel = sum(ref_params[n].numel() for n in views["state"])
    if wrapped.sharding_strategy is ftsdp.ShardingStrategy.NO_SHARD:
        numel *= dist.get_world_size()  # every rank holds every element
    assert covered.tolist() == [numel, numel], (label, covered, numel)


def cases_for(world: int) -> list[tuple[str, str, str, str]]:
    """The full grid at world size 3 (uneven: flat parameters pad); at 1, 2 and 4 a cover of
    every value of every dimension (each strategy x wrapping with accumulation + clipping,
    frozen and MLP models, and the plain path), to keep the suite within its time budget."""
    full = list(
        itertools.product(
            ["gpt", "gpt_frozen", "mlp"],
            STRATEGIES,
            ["flat", "units", "nested"],
            ["plain", "accum_clip"],
        )
    )
    if world == 3:
        return full
    return [
        c
        for c in full
        if (c[0] != "gpt" and c[2] != "units" and c[3] == "accum_clip")
        or (c[0] == "gpt" and c[2] == "units")
    ]


def parity_grid(rank: int, world: int) -> int:
    for kind, strategy, wrap, mode in cases_for(world):
        label = f"{kind}/{strategy}/{wrap}/{mode} W={world}"
        train_in_lockstep(kind, strategy, wrap, mode, rank, world, label)
    return len(cases_for(world))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_with_unsharded_training(spawns, world: int) -> None:
    # W=2, 3, 4: in the spawns shared with other modules; W=1 alone
    if world == 1:
        cases = run_ranks(parity_grid, world, start_method="forkserver")
    else:
        cases = spawns.result(world, "test_engine_parity.parity_grid")
    assert cases == [len(cases_for(world))] * world
