"""torch.compile over the engine: the whole wrapped model, and each block compiled before or after
wrapping, at world sizes 1-4, for every sharding strategy, with prefetching on and off and with
mixed precision (bf16 parameters; compiled with the aot_eager backend, see ``run_case``).

Every case trains the compiled model and an eager reference side by side on the same global batch
(each rank its share of it) with SGD: the full gradients must agree within 1e-6 at every step. Without mixed precision the reference is the unwrapped model on the whole batch; with it,
the same engine and policy run eagerly (bf16 compute differs from fp32 by far more than 1e-6).

A whole-model compile breaks the graph at each unit's forward hooks (they gather and free
parameters and run collectives: they run eagerly, see docs/engine.md, "torch.compile"); the test
checks that every break is one of those hooks, and that later steps compile nothing new (the
parameter views the engine exposes anew each step keep the guards).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ftsdp
from ftsdp.testing import run_ranks

MODES = ["whole", "blocks_then_wrap", "wrap_then_blocks"]
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
PER_RANK = 4
STEPS = 3
TOL = dict(rtol=0.0, atol=1e-6)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + x


class Net(nn.Module):
    """Three blocks of 13 (odd: flat parameters pad at world size 3 and 4) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(13), Block(13), Block(13))
        self.out = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


def wrap(
    strategy: str, prefetch: bool, mixed: bool, world: int, compile_first: str | None = None
) -> tuple[nn.Module, nn.Module]:
    """The same initial ``Net`` wrapped, and the inner module; ``compile_first``: each block is
    compiled with this backend before wrapping (torchtitan's order)."""
    torch.manual_seed(0)
    inner = Net()
    if compile_first:
        for block in inner.blocks:
            block.compile(backend=compile_first)
    kwargs: dict = {"backward_prefetch": prefetch, "forward_prefetch": prefetch}
    if mixed:
        kwargs["mixed_precision"] = ftsdp.MixedPrecision(param_dtype=torch.bfloat16)
    if strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["device_mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("r", "s"))
    return ftsdp.FSDP(inner, sharding_strategy=strategy, auto_wrap_policy={Block}, **kwargs), inner


def full_grads(model: nn.Module) -> list[torch.Tensor]:
    wrapped = isinstance(model, ftsdp.FSDP)
    full = ftsdp.FSDP.summon_full_params(model, with_grads=True)
    with full if wrapped else contextlib.nullcontext():
        return [p.grad.float().clone() for p in model.parameters()]


def run_case(rank: int, world: int, mode: str, strategy: str, prefetch: bool, mixed: bool) -> None:
    """Train the compiled model against its eager reference: the same gradients at every step,
    graph breaks only at the engine's hooks, and nothing compiled after the first step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    # In bf16, inductor's fused kernels round differently from eager's (gradients differ by up
    # to 4e-3): mixed precision compiles with the aot_eager backend, the same graphs (hooks,
    # breaks, casts) run by eager kernels, so any difference left is the engine's.
    backend = "aot_eager" if mixed else "inductor"
    if backend == "inductor":
        import torch._inductor.config

        # cpuinfo names the CPU's vector ISAs: trust it rather than compile a probe of each
        # (5 g++ runs over torch's headers, 15 s on a cold cache; nothing the engine does)
        torch._inductor.config.cpp.vec_isa_ok = True
    label = f"{mode}/{strategy}/prefetch={prefetch}/mixed={mixed} W={world}"
    if mixed:
        reference, _ = wrap(strategy, prefetch, mixed, world)
    else:
        torch.manual_seed(0)
        reference = Net()
    first = backend if mode == "blocks_then_wrap" else None
    model, inner = wrap(strategy, prefetch, mixed, world, compile_first=first)
    if mode == "wrap_then_blocks":
        for block in inner.blocks:
            block.compile(backend=backend)
    run = torch.compile(model, backend=backend) if mode == "whole" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(STEPS):
        x = torch.randn(PER_RANK * world, 13, generator=generator)
        y = torch.randn(PER_RANK * world, 5, generator=generator)
        ref_x, ref_y = (x[mine], y[mine]) if mixed else (x, y)
        nn.functional.mse_loss(reference(ref_x).float(), ref_y).backward()
        counters.clear()
        nn.functional.mse_loss(run(x[mine]).float(), y[mine]).backward()
        for got, want in zip(full_grads(model), full_grads(reference), strict=True):
            torch.testing.assert_close(got, want, **TOL, msg=lambda m, s=step: f"{label} {s}: {m}")
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        if step == 0:
            assert bool(counters["graph_break"]) == (mode == "whole"), (label, counters)
            for reason in counters["graph_break"]:
                assert "Runtime._p" in reason and "_forward_hook" in reason, (label, reason)
        else:
            assert not counters["stats"].get("unique_graphs"), (label, step, counters["stats"])


def cases_for(world: int) -> list[tuple[str, str, bool, bool]]:
    """The suite's cover: every (mode, strategy) at W=2, settings rotating (prefetching on,
    off, mixed precision with prefetching); at 1, 3 and 4 the whole-model compile (the one that
    needs the engine's help), with HYBRID_SHARD (2 x 2) at 4. Each case traces anew, so the
    full cross product (``python -m tests.distributed.test_engine_compile W``, docs/engine.md)
    would cost minutes of the suite."""
    if world == 2:
        settings = [(True, True), (True, False), (False, False)]
        pairs = [(m, s) for m in MODES for s in STRATEGIES]
        return [(m, s, *settings[(i + (m == MODES[2])) % 3]) for i, (m, s) in enumerate(pairs)]
    return {
        1: [("whole", "FULL_SHARD", True, False), ("whole", "SHARD_GRAD_OP", True, True)],
        3: [("whole", "FULL_SHARD", False, False), ("whole", "NO_SHARD", True, True)],
        4: [("whole", "FULL_SHARD", True, True), ("whole", "HYBRID_SHARD", True, False)],
    }[world]


def full_matrix(world: int) -> list[tuple[str, str, bool, bool]]:
    """Every mode x strategy x prefetching x mixed precision at ``world``."""
    strategies = [*STRATEGIES, *(["HYBRID_SHARD"] if world == 4 else [])]
    return [
        (m, s, p, mp)
        for m in MODES
        for s in strategies
        for p in (True, False)
        for mp in (False, True)
    ]


def compile_grid(rank: int, world: int, cases: list | None = None) -> int:
    """Conftest phase: every case of ``cases`` (default ``cases_for(world)``); the number run."""
    cases = cases_for(world) if cases is None else cases
    for case in cases:
        run_case(rank, world, *case)
    return len(cases)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_compiled_training_matches_eager(spawns, world: int) -> None:
    # W=2, 3, 4: in the spawns shared with other modules; W=1 alone
    if world == 1:
        done = run_ranks(compile_grid, world, start_method="forkserver")
    else:
        done = spawns.result(world, "test_engine_compile.compile_grid")
    assert done == [len(cases_for(world))] * world


if __name__ == "__main__":  # the full matrix at one world size: python -m ... W
    import sys

    w = int(sys.argv[1])
    done = run_ranks(compile_grid, w, full_matrix(w), timeout=3600)
    print(f"W={w}: {done[0]} cases, every gradient within 1e-6 of eager training")
