"""fp16 loss scaling with sharded gradients, on one spawn of 2 gloo ranks.

- An overflow that only one rank sees (an inf in its gradient shard): with
  ``ftsdp.ShardedGradScaler`` both ranks skip the step and halve the scale; with a plain
  ``torch.amp.GradScaler`` (the control) the ranks disagree, which is the bug it prevents.
- fp16 training (MixedPrecision(param_dtype=float16)) with a scale so large that the first
  steps overflow: every rank skips the same steps and keeps the same scale, and the losses
  follow an fp32 unwrapped reference that skips those steps too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ftsdp
from ftsdp.examples.gpt import GPT, Block, GPTConfig, param_groups

WORLD = 2
CONFIG = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)
FP16 = ftsdp.MixedPrecision(param_dtype=torch.float16)


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 37, (2 * WORLD, 9), generator=torch.Generator().manual_seed(step))


def one_rank_overflow(rank: int, scaler_cls: type) -> dict:
    model = ftsdp.FSDP(gpt(), auto_wrap_policy={Block}, mixed_precision=FP16)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    scaler = scaler_cls("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    t = tokens(0)[2 * rank : 2 * rank + 2]
    scaler.scale(model(t[:, :-1], t[:, 1:])[1]).backward()
    if rank == 1:  # an overflow in this rank's shard only
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.numel())
        grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    return {"stepped": stepped, "scale": scaler.get_scale()}


def fp16_training(rank: int, steps: int = 10) -> dict:
    model = ftsdp.FSDP(gpt(), auto_wrap_policy={Block}, mixed_precision=FP16)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    scaler = ftsdp.ShardedGradScaler("cpu", init_scale=2.0**18, growth_interval=1000)
    reference = gpt()
    ref_opt = torch.optim.AdamW(param_groups(reference, 0.1), lr=1e-2)
    losses, ref_losses, scales, skipped = [], [], [], []
    for step in range(steps):
        t = tokens(step % 2)  # two batches, repeated: the loss can fall (random tokens)
        mine = t[2 * rank : 2 * rank + 2]
        loss = model(mine[:, :-1], mine[:, 1:])[1]
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skip = scaler.get_scale() < scale
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / WORLD)
        ref_loss = reference(t[:, :-1], t[:, 1:])[1]
        ref_loss.backward()
        if not skip:  # the reference skips exactly the steps the scaler skipped
            ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss))
        scales.append(scale)
        skipped.append(skip)
    return {"losses": losses, "ref": ref_losses, "scales": scales, "skipped": skipped}


def rank_main(rank: int, world: int) -> dict:
    return {
        "sharded": one_rank_overflow(rank, ftsdp.ShardedGradScaler),
        "plain": one_rank_overflow(rank, torch.amp.GradScaler),
        "training": fp16_training(rank),
    }


@pytest.fixture(scope="module")
def results(spawns) -> list[dict]:
    return spawns.result(WORLD, "test_engine_grad_scaler.rank_main")  # rank_main at W=2


@pytest.mark.timeout(600)  # the first test runs the shared spawn (conftest.py)
def test_every_rank_skips_an_overflow_only_one_rank_saw(results):
    sharded = [r["sharded"] for r in results]
    assert [s["stepped"] for s in sharded] == [False, False], sharded
    assert [s["scale"] for s in sharded] == [512.0, 512.0], sharded
    plain = [r["plain"] for r in results]  # the control: a plain GradScaler diverges
    assert plain[0]["stepped"] and not plain[1]["stepped"], plain
    assert plain[0]["scale"] != plain[1]["scale"], plain


@pytest.mark.timeout(600)  # the first test runs the shared spawn (conftest.py)
def test_fp16_training_skips_together_and_follows_fp32(results):
    runs = [r["training"] for r in results]
    assert runs[0]["scales"] == runs[1]["scales"], runs
    assert runs[0]["skipped"] == runs[1]["skipped"], runs
    assert any(runs[0]["skipped"]) and not all(runs[0]["skipped"]), runs[0]["skipped"]
    torch.testing.assert_close(
        torch.tensor(runs[0]["losses"]), torch.tensor(runs[0]["ref"]), rtol=0, atol=2e-2
    )
    assert runs[0]["losses"][-1] < runs[0]["losses"][0] - 0.05, runs[0]


def test_single_process_acts_as_grad_scaler():
    model = ftsdp.FSDP(copy.deepcopy(gpt()), auto_wrap_policy={Block}, mixed_precision=FP16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = ftsdp.ShardedGradScaler("cpu", init_scale=2.0**30)
    t = tokens(0)
    scaler.scale(model(t[:, :-1], t[:, 1:])[1]).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.process_group is None
    assert scaler.get_scale() == 2.0**29  # fp16 gradients overflowed at 2**30: skipped
