"""The main job: train a small GPT on a synthetic language with the ftsdp FSDP engine.

    torchrun --standalone --nproc-per-node=2 -m ftsdp.train [--steps N --global-batch B ...]
    python -m ftsdp.train            # one process, world size 1
    ftsdp-train --help               # every flag, generated from TrainConfig

parse -> build -> run -> close; the logic lives in ``ftsdp._train_config`` (flags, validation)
and ``ftsdp._train_loop`` (process group, schedule, step loop, log).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

import ftsdp
from ftsdp._train_config import TrainConfig, parse_args
from ftsdp._train_loop import (
    DistEnv,
    MetricsLog,
    close_distributed,
    init_distributed,
    start_record,
    train,
)
from ftsdp.data import MarkovDataset
from ftsdp.model import GPT, Block, param_groups


def build(cfg: TrainConfig, env: DistEnv) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """The wrapped model and its optimizer (created after wrapping, on the sharded views)."""
    torch.manual_seed(cfg.seed)  # same init on every rank
    module = GPT(cfg.model_config())
    n_params = module.num_parameters()
    model = ftsdp.FSDP(
        module.to(env.device),
        auto_wrap_policy={Block},
        sharding_strategy=ftsdp.ShardingStrategy[cfg.sharding_strategy],
        device_id=env.device if env.device.type == "cuda" else None,
    )
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95)
    )
    return model, optimizer, n_params


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    env = init_distributed(cfg.device)
    log = MetricsLog(cfg.metrics, enabled=env.rank == 0)
    try:
        cfg.accum_steps(env.world_size)  # fail fast, before building, on a bad batch geometry
        dataset = MarkovDataset(cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        model, optimizer, n_params = build(cfg, env)
        head = start_record(cfg, env, n_params, dataset)
        log.write(
            f"ftsdp.train | world {env.world_size} | {env.device} | {cfg.sharding_strategy} | "
            f"{n_params / 1e6:.2f}M params | global batch {cfg.global_batch} = micro "
            f"{cfg.micro_batch} x accum {head['accum_steps']} x ranks {env.world_size} | "
            f"loss at init ~ ln(V) = {dataset.uniform_loss:.3f}, "
            f"achievable ~ {dataset.entropy_rate:.3f} (chain entropy rate)",
            head,
        )
        t0 = time.perf_counter()
        loss = train(cfg, env, model, optimizer, dataset, log)
        wall = time.perf_counter() - t0
        log.write(
            f"done | {cfg.steps} steps in {wall:.1f}s | final loss {loss:.4f}",
            {"event": "done", "steps": cfg.steps, "wall_s": wall, "loss": loss},
        )
        return 0 if math.isfinite(loss) else 1
    finally:
        log.close()
        close_distributed()


if __name__ == "__main__":
    raise SystemExit(main())
