"""What one training run works on: data, the wrapped model, its optimizer and learning-rate
schedule, the checkpoints; :func:`build` makes it inside an open session.

The engine is used only through its public wrapper; nothing here knows about flat parameters.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

import ftsdp
from ftsdp.elastic import BatchGeometry, GlobalSampler
from ftsdp.trainer._checkpoint import CheckpointManager
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._session import Session
from ftsdp.trainer.data import MarkovDataset
from ftsdp.trainer.model import GPT, Block, param_groups


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def storage_options_from_env() -> dict[str, Any] | None:
    """``FTSDP_STORAGE_OPTIONS`` (a JSON object, e.g. endpoint_url/key/secret), or None.

    Read from the environment, not a flag: the config is saved in every checkpoint, and
    secrets do not belong there (nor in ``ps`` output)."""
    raw = os.environ.get("FTSDP_STORAGE_OPTIONS")
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"FTSDP_STORAGE_OPTIONS must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("FTSDP_STORAGE_OPTIONS must be a JSON object")
    return value


@dataclass
class Job:
    """What one training run works on, made by :func:`build`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: MarkovDataset
    sampler: GlobalSampler
    geometry: BatchGeometry
    n_params: int
    ckpt: CheckpointManager | None = None  # None without --checkpoint-url
    deterministic_engine: bool = False
    clip: float = math.inf  # max gradient norm; inf only measures it


def build(cfg: TrainConfig, session: Session) -> Job:
    """Data, the wrapped model, its optimizer (after wrapping) and schedule, the checkpoints."""
    rm = session.rm
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
        ckpt = CheckpointManager(
            session.hook.checkpoint_url(cfg.checkpoint_url),
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
