"""bf16 mixed precision: ftsdp.FSDP against torch FSDP2 (``fully_shard``), the same GPT, seed, data
and optimizer, on CPU / gloo, in the spawns of this folder (W=2 and W=3, see conftest.py).

Both engines compute in bf16 from fp32 master shards (``param_dtype=torch.bfloat16``), reduce in
the same ``reduce_dtype`` and hand fp32 gradients to the optimizer, so the question is only how
each reduces. What holds, and is asserted:

- where the reductions cannot round differently, training is bitwise the same: with W=2 a bf16
  sum of two gradients is one rounding whatever the order (addition commutes) and dividing by 2
  is exact; with ``reduce_dtype=torch.float32`` at W=2 and W=3 the fp32 sums come out equal too
  (found so with this torch: the same fp32 roundings). Losses, the final parameters and the dtypes seen
  inside the model are compared exactly over ``STEPS``.
- bf16 reduced at W=3 is not bitwise, by design: the engines reduce through different gloo
  collectives (ftsdp: an all-reduce of its flat buffer, SUM; FSDP2: ``reduce_scatter_tensor``
  with ``ReduceOp.AVG``), whose bf16 partial sums of three terms may round differently (found:
  one bf16 ulp of the sum on some elements), and FSDP2 divides by 3 in bf16 where ftsdp divides
  the bf16 sum in fp32. So after one step both gradients are compared with the exact mean of
  the ranks' local bf16 gradients g_r (a plain bf16 copy of the model on each rank): with
  u = 2**-8 (bf16's unit roundoff) and A = sum |g_r|, a sum of three rounded twice is within
  (2u + u**2) A of the exact one; ftsdp's fp32 division adds 2**-24 of the result, FSDP2's
  bf16 division u of it. Over several steps Adam turns those last-bit differences into
  update-sized ones, so no trajectory bound tighter than a loose one exists there.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ftsdp
from ftsdp.examples.gpt import GPT, Block, GPTConfig

SEQ, GLOBAL_BATCH, STEPS = 8, 12, 4  # 12: 2 and 3 ranks get whole batches
U = 2.0**-8  # bf16 unit roundoff (8 significant bits)
CASES = {2: ["bf16-reduce", "fp32-reduce"], 3: ["fp32-reduce", "bf16-reduce-first-grads"]}


def _config() -> GPTConfig:
    return GPTConfig(vocab_size=37, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)


def _batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 37, (GLOBAL_BATCH, SEQ + 1), generator=g)
    mine = tokens[rank * GLOBAL_BATCH // world : (rank + 1) * GLOBAL_BATCH // world]
    return mine[:, :-1], mine[:, 1:]


def _engines(world: int, mesh: Any, reduce_dtype: torch.dtype) -> tuple[GPT, Any, Any, list]:
    """The reference GPT (fp32), ftsdp.FSDP and FSDP2 over copies of it (units: the Blocks and
    the root), and the (weight dtype, output dtype) each engine's first MLP sees in forward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    reference = GPT(_config())
    seen: list = []
    ours_model, theirs = copy.deepcopy(reference), copy.deepcopy(reference)
    for engine, model in (("ftsdp", ours_model), ("fsdp2", theirs)):
        model.blocks[0].mlp.c_fc.register_forward_hook(
            lambda m, _i, out, e=engine: seen.append((e, m.weight.dtype, out.dtype))
        )
    mp = ftsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    ours = ftsdp.FSDP(ours_model, auto_wrap_policy={Block}, mixed_precision=mp)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(theirs, mesh=mesh, mp_policy=policy)
    return reference, ours, theirs, seen


def _trajectory(rank: int, world: int, mesh: Any, reduce_dtype: torch.dtype) -> dict[str, Any]:
    """Train both engines ``STEPS`` AdamW steps; their losses, dtypes seen and the largest
    difference of the final full parameters."""
    _, ours, theirs, seen = _engines(world, mesh, reduce_dtype)
    # The same update code on both sides (DTensor or plain shards): the per-tensor loop.
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (ours, theirs)]
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, world, step)
        pair = []
        for model, opt in zip((ours, theirs), opts, strict=True):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            pair.append(loss.item())
        losses.append(tuple(pair))
    full = ours.state_dict()
    diff = {n: (full[n] - p.full_tensor()).abs().max().item() for n, p in theirs.named_parameters()}
    names = sorted(full) == sorted([*diff, "lm_head.weight"])  # the tied head: one parameter
    return {"losses": losses, "max_diff": max(diff.values()), "names": names, "seen": set(seen)}


def _first_grads(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """One backward of both engines (bf16 reduce) and of a plain bf16 copy of the model on this
    rank's batch; each engine's gradient shard against the exact mean of the ranks' local bf16
    gradients, as multiples of ``U * mean |g_r|`` (the bounds of the module docstring)."""
    reference, ours, theirs, _ = _engines(world, mesh, torch.bfloat16)
    local = copy.deepcopy(reference).to(torch.bfloat16)
    x, y = _batch(rank, world, 0)
    for model in (ours, theirs, local):
        model(x, y)[1].backward()
    views = ours.sharded_state_dict()
    ours_params, local_params = dict(ours.named_parameters()), dict(local.named_parameters())
    worst = {"ftsdp": 0.0, "fsdp2": 0.0}
    exact_zero_ok = True
    for name, p in theirs.named_parameters():
        g = local_params[name].grad.reshape(-1)
        every = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(every, g)
        stacked = torch.stack(every).double()
        mean, scale = stacked.mean(0), U * stacked.abs().mean(0)  # U * A / W
        view = views[name]
        part = slice(view.offset, view.offset + view.length)
        full_theirs = p.grad.full_tensor().reshape(-1)
        for engine, got in (("ftsdp", ours_params[name].grad), ("fsdp2", full_theirs[part])):
            err = (got.double() - mean[part]).abs()
            nonzero = scale[part] > 0
            exact_zero_ok &= bool((err[~nonzero] == 0).all())
            if nonzero.any():
                worst[engine] = max(
                    worst[engine], (err[nonzero] / scale[part][nonzero]).max().item()
                )
    return {"worst": worst, "exact_zero_ok": exact_zero_ok}


def mixed_precision(rank: int, world: int) -> dict[str, Any]:
    """Rank function of the shared spawns: every case of ``CASES[world]``, by name."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, Any] = {}
    for case in CASES[world]:
        if case == "bf16-reduce-first-grads":
            out[case] = _first_grads(rank, world, mesh)
        else:
            reduce_dtype = torch.bfloat16 if case.startswith("bf16") else torch.float32
            out[case] = _trajectory(rank, world, mesh, reduce_dtype)
    return out


def _case(spawns, world: int, case: str) -> list[dict[str, Any]]:
    return [
        r[case] for r in spawns.result(world, "test_engine_mixed_precision_fsdp2.mixed_precision")
    ]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("world", "case"), [(w, c) for w, cases in CASES.items() for c in cases if "grads" not in c]
)
def test_bf16_training_is_bitwise_fsdp2s(spawns, world: int, case: str) -> None:
    for rank, r in enumerate(_case(spawns, world, case)):
        assert r["names"], rank
        assert r["seen"] == {
            ("ftsdp", torch.bfloat16, torch.bfloat16),
            ("fsdp2", torch.bfloat16, torch.bfloat16),
        }
        assert all(a == b for a, b in r["losses"]), (rank, r["losses"])
        assert r["max_diff"] == 0.0, (rank, r["max_diff"])
        assert r["losses"][-1] != r["losses"][0]  # it trained


@pytest.mark.timeout(600)
def test_bf16_reduced_gradients_at_3_ranks_are_within_the_rounding_bound(spawns) -> None:
    # (2u + u^2) A / W for both sums; + 2**-24 |mean| (ftsdp) or u |mean| (FSDP2), |mean| <= A / W
    bound = {"ftsdp": 2 + U + 2**-15, "fsdp2": (2 + U) * (1 + U) + 1}
    for rank, r in enumerate(_case(spawns, 3, "bf16-reduce-first-grads")):
        assert r["exact_zero_ok"], rank
        for engine, worst in r["worst"].items():
            assert 0 < worst <= bound[engine], (rank, engine, worst, bound[engine])
