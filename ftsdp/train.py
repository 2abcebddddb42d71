"""The main job: train a small GPT on a synthetic language with the ftsdp FSDP engine, elastically.

    torchrun --standalone --nproc-per-node=2 -m ftsdp.train [--steps N --global-batch B ...]
    torchrun --nnodes=1:2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --max-restarts=3 \\
        -m ftsdp.train --checkpoint-url s3://bucket/run --deterministic
    python -m ftsdp.train            # one process, world size 1
    ftsdp-train --help               # every flag, generated from TrainConfig

parse -> build -> run -> close; the logic lives in ``ftsdp.trainer._config`` (flags, validation),
``ftsdp.trainer._loop`` (session, step loop, logs), ``ftsdp.elastic`` (rank manager, sampler,
signals, watchdog) and ``ftsdp.trainer._checkpoint`` (CheckpointManager). See docs/elastic.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

import ftsdp
from ftsdp.elastic import GlobalSampler
from ftsdp.trainer._checkpoint import CheckpointManager
from ftsdp.trainer._config import TrainConfig, parse_args
from ftsdp.trainer._loop import (
    Job,
    Session,
    lr_at,
    run,
    start_record,
    storage_options_from_env,
)
from ftsdp.trainer.data import MarkovDataset
from ftsdp.trainer.model import GPT, Block, param_groups


def build(cfg: TrainConfig, session: Session) -> Job:
    """Data, the wrapped model, its optimizer (after wrapping) and schedule, the checkpoints."""
    rm = session.rm
    assert rm is not None
    geometry = cfg.geometry(rm.world_size)  # fails fast on a world size that cannot work
    dataset = MarkovDataset(cfg.vocab_size, cfg.block_size, seed=cfg.seed)
    sampler = GlobalSampler(len(dataset), seed=cfg.seed, shuffle=cfg.shuffle)
    torch.manual_seed(cfg.seed)  # same init on every rank
    module = GPT(cfg.model_config())
    n_params = module.num_parameters()
    model = ftsdp.FSDP(
        module.to(rm.device),
        auto_wrap_policy={Block},
        sharding_strategy=ftsdp.ShardingStrategy[cfg.sharding_strategy],
        device_id=rm.device if rm.device.type == "cuda" else None,
        deterministic=cfg.deterministic,
    )
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.lr)
    ckpt = None
    if cfg.checkpoint_url:
        assert session.faults is not None
        ckpt = CheckpointManager(
            session.faults.checkpoint_url(cfg.checkpoint_url),
            model,
            optimizer,
            lr_scheduler=scheduler,
            every_steps=cfg.checkpoint_every or None,
            every_seconds=cfg.checkpoint_every_s or None,
            keep_last=cfg.keep_last,
            async_save=cfg.async_save,
            storage_options=storage_options_from_env(),
            seed=cfg.seed,
            log=lambda line: session.log.event(
                {"event": "checkpoint_warning", "message": line}, line
            ),
        )
    return Job(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataset=dataset,
        sampler=sampler,
        geometry=geometry,
        n_params=n_params,
        ckpt=ckpt,
        deterministic_engine=cfg.deterministic,
        clip=cfg.grad_clip if cfg.grad_clip > 0 else math.inf,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    session = Session.open(cfg)
    try:
        rm, log = session.rm, session.log
        assert rm is not None
        job = build(cfg, session)
        head = start_record(cfg, rm, job)
        g = job.geometry
        log.write(
            f"ftsdp.train | world {rm.world_size} | {rm.device} | {cfg.sharding_strategy} | "
            f"{job.n_params / 1e6:.2f}M params | global batch {cfg.global_batch} = micro "
            f"{cfg.micro_batch} x accum {g.accum_steps} x ranks {rm.world_size} | "
            f"loss at init ~ ln(V) = {job.dataset.uniform_loss:.3f}, "
            f"achievable ~ {job.dataset.entropy_rate:.3f} (chain entropy rate) | "
            f"generation {rm.generation}",
            head,
        )
        t0 = time.perf_counter()
        out = run(cfg, session, job)
        wall = time.perf_counter() - t0
        if not out.preempted:
            log.write(
                f"done | {cfg.steps} steps in {wall:.1f}s | final loss {out.loss:.4f}",
                {
                    "event": "done",
                    "steps": cfg.steps,
                    "wall_s": wall,
                    "loss": out.loss,
                    "time": time.time(),
                },
            )
        if out.exit_code or out.preempted:
            return out.exit_code
        return 0 if math.isfinite(out.loss) or out.steps_run == 0 else 1
    except BaseException as e:
        session.log.event(
            {"event": "error", "error": f"{type(e).__name__}: {e}"[:2000]},
            f"ftsdp.train rank {session.rm.rank if session.rm else '?'}: {type(e).__name__}: {e}",
        )
        raise
    finally:
        session.close()


if __name__ == "__main__":
    raise SystemExit(main())
