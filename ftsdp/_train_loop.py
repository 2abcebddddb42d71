"""The training entry's runtime: process group from the torchrun environment, learning-rate
schedule, the step loop with gradient accumulation, and rank 0's log (stdout + JSONL).

The engine is used only through its public wrapper (``model(idx, targets)``, ``no_sync()``,
``clip_grad_norm_``); nothing here knows about flat parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist

from ftsdp._train_config import TrainConfig
from ftsdp.data import MarkovDataset, rank_sample_indices


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process runs: its place in the world (from torchrun's env) and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


def init_distributed(device: str) -> DistEnv:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*), or
    form a one-rank group when started as a plain process; gloo on CPU, nccl on CUDA."""
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                "device='cuda' but torch.cuda.is_available() is False; use --device cpu"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        # Ranks on one host share its cores: oversubscribing them slows every rank down.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // max(1, local_world_size)))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        elif world_size == 1:
            # A plain `python -m ftsdp.train`: an in-memory store is enough for one rank, so the
            # engine and the loop run the same code path as under torchrun.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            raise ValueError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: launch with torchrun"
            )
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=dev,
    )


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


class MetricsLog:
    """Rank 0's log: one line per interval on stdout, and optionally one JSON record each."""

    def __init__(self, path: str | None, enabled: bool):
        self.enabled = enabled
        self._file: IO[str] | None = None
        if enabled and path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, line: str, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        print(line, flush=True)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def train(
    cfg: TrainConfig,
    env: DistEnv,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: MarkovDataset,
    log: MetricsLog,
) -> float:
    """Run ``cfg.steps`` optimizer steps; returns the last logged (global mean) loss."""
    accum = cfg.accum_steps(env.world_size)
    tokens_per_step = cfg.global_batch * cfg.block_size
    clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: only measure the norm
    # [loss sum, micro-batch count] since the last log line, reduced over ranks when logging.
    window = torch.zeros(2, device=env.device)
    last_loss = math.nan
    t_window, steps_in_window = time.perf_counter(), 0
    model.train()
    for step in range(cfg.steps):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(accum):
            idx = rank_sample_indices(
                step,
                micro,
                rank=env.rank,
                world_size=env.world_size,
                global_batch=cfg.global_batch,
                micro_batch=cfg.micro_batch,
            )
            x, y = (t.to(env.device, non_blocking=True) for t in dataset.batch(idx))
            # Gradients reduce across ranks only on the last micro-batch of the step.
            sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
            with sync:
                _, loss = model(x, y)
                (loss / accum).backward()
            window[0] += loss.detach()
            window[1] += 1
        grad_norm = model.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps_in_window += 1

        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            dist.all_reduce(window)  # every rank reaches this line at the same steps
            last_loss = (window[0] / window[1]).item()
            elapsed = time.perf_counter() - t_window
            record = {
                "event": "step",
                "step": step + 1,
                "loss": last_loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": tokens_per_step * steps_in_window / elapsed,
                "s_per_step": elapsed / steps_in_window,
            }
            log.write(
                f"step {step + 1}/{cfg.steps} | loss {last_loss:.4f} | "
                f"tokens/s {record['tokens_per_s']:.0f} | s/step {record['s_per_step']:.3f} | "
                f"grad_norm {record['grad_norm']:.3f} | lr {lr:.2e}",
                record,
            )
            window.zero_()
            t_window, steps_in_window = time.perf_counter(), 0
    return last_loss


def start_record(cfg: TrainConfig, env: DistEnv, n_params: int, dataset: MarkovDataset) -> dict:
    return {
        "event": "start",
        "config": dataclasses.asdict(cfg),
        "world_size": env.world_size,
        "device": str(env.device),
        "accum_steps": cfg.accum_steps(env.world_size),
        "n_params": n_params,
        "loss_floor": dataset.entropy_rate,
        "loss_uniform": dataset.uniform_loss,
    }
