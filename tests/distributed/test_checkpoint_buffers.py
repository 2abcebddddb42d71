"""DDP and ``ftsdp.FSDP`` with BatchNorm under CheckpointManager at W=2: after a forward each rank
holds running statistics of its own data (DDP broadcasts rank 0's before the next forward; the
FSDP engine leaves them, as torch FSDP does). The checkpoint holds rank 0's, never a mix of
the ranks' (the FSDP engine's used to take each buffer from whichever rank storage chose), and
a resumed DDP run equals the uninterrupted one; a resumed FSDP run equals it in everything but
the other ranks' statistics (they resume from rank 0's)."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from ftsdp.testing import run_ranks

pytestmark = pytest.mark.timeout(240)


def _ranks(rank: int, world: int, root: str, engine: str) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ftsdp
    from ftsdp.checkpoint import CheckpointManager

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
        model = DDP(net) if engine == "ddp" else ftsdp.FSDP(net)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(step * 10 + rank)
            x = torch.randn(16, 4, generator=g) + 3 * rank  # each rank its own data
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    model, opt = build()
    with CheckpointManager(f"{root}/ckpt", model, opt) as ckpt:
        ckpt.resume({"step": 0})
        train(model, opt, range(1, 4))
        ckpt.save(3, {"step": 3})
        bn = model.module[1]
        at_save = [bn.running_mean.clone(), bn.running_var.clone()]
    train(model, opt, range(4, 7))
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    resumed, opt2 = build()
    with CheckpointManager(f"{root}/ckpt", resumed, opt2) as ckpt:
        trainer = {"step": 0}
        assert ckpt.resume(trainer) is not None and trainer == {"step": 3}
        train(resumed, opt2, range(4, 7))
    after = resumed.state_dict()
    return {
        "at_save": [t.tolist() for t in at_save],
        "differ": [k for k in uninterrupted if not torch.equal(uninterrupted[k], after[k])],
    }


@pytest.mark.parametrize("engine", ["ddp", "ftsdp"])
def test_buffers_are_saved_from_rank_0_and_the_resumed_run_is_bitwise(
    tmp_path: pathlib.Path, engine: str
) -> None:
    from ftsdp import storage

    out = run_ranks(_ranks, 2, str(tmp_path), engine, start_method="forkserver", timeout=180)
    assert out[0]["at_save"] != out[1]["at_save"]  # the ranks' statistics did differ
    saved = storage.load_state_dict(str(tmp_path / "ckpt"))
    assert saved["model.1.running_mean"].tolist() == out[0]["at_save"][0]
    assert saved["model.1.running_var"].tolist() == out[0]["at_save"][1]
    if engine == "ddp":
        assert [r["differ"] for r in out] == [[], []]
    else:  # rank 1 resumed rank 0's statistics, which it had not
        statistics = ["1.running_mean", "1.running_var"]
        assert [r["differ"] for r in out] == [[], statistics]
