"""The training entry's runtime: the elastic session around the job, the learning-rate schedule,
the step loop with gradient accumulation and checkpoints, and rank 0's logs (stdout + JSONL).

The engine is used only through its public wrapper (``model(idx, targets)``, ``no_sync()``,
``clip_grad_norm_``, the sharded state dicts); nothing here knows about flat parameters.

[Note: one agreement per step boundary]
After every optimizer step the ranks run one ``all_reduce(MAX)`` over two flags: "a rank was
preempted" and "a time-based checkpoint is due on some rank". Every rank therefore takes the
same decision at the same step (save, stop), and a rank that was not signalled still saves
with the others. Faults of the suite fire at the same boundaries (``ftsdp.testing._faults``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist

from ftsdp.elastic import (
    EXIT_PEER_PREEMPTED,
    BatchGeometry,
    GlobalSampler,
    PreemptionHandler,
    RankManager,
    Watchdog,
)
from ftsdp.testing._faults import FaultInjector
from ftsdp.trainer._checkpoint import CheckpointManager
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer.data import MarkovDataset


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


class MetricsLog:
    """Rank 0's log: one line per interval on stdout, and optionally one JSON record each.

    ``event`` records (errors, faults seen, resumes) may come from any rank: each is one
    ``write`` of one line to a file opened for appending, so ranks do not interleave.
    """

    def __init__(self, path: str | None, enabled: bool, rank: int = 0):
        self.enabled = enabled
        self.rank = rank
        self._file: IO[str] | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, line: str, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        print(line, flush=True)
        self._append(record)

    def event(self, record: dict[str, Any], line: str | None = None) -> None:
        """A record from any rank (stamped with rank and wall time); ``line`` goes to stderr."""
        if line:
            print(line, file=sys.stderr, flush=True)
        self._append({**record, "rank": self.rank, "time": time.time()})

    def _append(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class Session:
    """The elastic runtime around one worker: rank manager, logs, signals, watchdog, faults.

    ``open`` builds it in order; ``close`` always works, even half-built, and closes in reverse.
    """

    cfg: TrainConfig
    rm: RankManager | None = None
    log: MetricsLog = field(default_factory=lambda: MetricsLog(None, False))
    faults: FaultInjector | None = None
    preempt: PreemptionHandler | None = None
    watchdog: Watchdog | None = None
    ledger: IO[str] | None = None

    @classmethod
    def open(cls, cfg: TrainConfig) -> Session:
        s = cls(cfg)
        try:
            s.rm = RankManager.init(
                device=cfg.device,
                timeout_s=cfg.pg_timeout_s,
                threads=1 if cfg.deterministic else None,
            )
            rank = s.rm.rank
            s.log = MetricsLog(cfg.metrics, enabled=rank == 0, rank=rank)
            s.faults = FaultInjector.from_env(rank, s.rm.info.restart_count).bind(s.rm.incarnation)
            s.preempt = PreemptionHandler(grace_s=cfg.preempt_grace_s).install()
            if s.rm.world_size > 1 and cfg.heartbeat_timeout_s > 0:
                store = s.rm.store("watchdog", timeout_s=cfg.heartbeat_timeout_s)
                s.watchdog = Watchdog(
                    store,
                    rank,
                    s.rm.world_size,
                    interval_s=min(1.0, cfg.heartbeat_timeout_s / 4),
                    heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                    progress_timeout_s=cfg.progress_timeout_s or None,
                    peers=[(p.host, p.pid) for p in s.rm.peers],
                    log=lambda line: s.log.event({"event": "stall", "message": line}, line),
                ).start()
            if cfg.ledger and rank == 0:
                os.makedirs(os.path.dirname(os.path.abspath(cfg.ledger)), exist_ok=True)
                s.ledger = open(cfg.ledger, "a", encoding="utf-8")  # noqa: SIM115 - close()
        except BaseException:
            s.close()
            raise
        return s

    def close(self) -> None:
        for closer in (
            self.watchdog and self.watchdog.close,
            self.preempt and self.preempt.close,
            self.ledger and self.ledger.close,
            self.log.close,
            self.rm and self.rm.close,
        ):
            if closer:
                with contextlib.suppress(Exception):
                    closer()


@dataclass
class Job:
    """What one training run works on, built by ``ftsdp.train.build``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: MarkovDataset
    sampler: GlobalSampler
    geometry: BatchGeometry
    n_params: int
    ckpt: CheckpointManager | None = None
    deterministic_engine: bool = False
    clip: float = math.inf  # max gradient norm; inf only measures it


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


def _config_json(cfg: TrainConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), sort_keys=True)


# Fields that change what is trained: a resume with other values is refused.
_MUST_MATCH = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "seed", "global_batch")


@dataclass
class Outcome:
    loss: float = math.nan
    steps_run: int = 0
    exit_code: int = 0
    preempted: bool = False


def _resume(cfg: TrainConfig, session: Session, job: Job, trainer: dict[str, Any]) -> None:
    """Load the newest usable checkpoint into the job and ``trainer``; log it."""
    rm, log = session.rm, session.log
    assert rm is not None and job.ckpt is not None
    resumed = job.ckpt.resume(trainer)
    if resumed is None:
        return
    saved = json.loads(trainer["config"])
    bad = [
        f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}"
        for k in _MUST_MATCH
        if saved.get(k) != getattr(cfg, k)
    ]
    if bad:
        raise ValueError(
            f"the checkpoint at {cfg.checkpoint_url} (step {resumed.step}) was trained with "
            f"another configuration: {'; '.join(bad)}; use another --checkpoint-url"
        )
    trainer.update(
        restarts=trainer["restarts"] + 1, world_size=rm.world_size, config=_config_json(cfg)
    )
    skipped = [s for s, _ in resumed.skipped]
    log.write(
        f"resumed step {resumed.step} (saved at world {resumed.saved_world_size}, now "
        f"{rm.world_size}) in {resumed.seconds:.2f}s | restart {trainer['restarts']}"
        + (f" | skipped unusable steps {skipped}" if skipped else ""),
        {
            "event": "resume",
            "step": resumed.step,
            "saved_world_size": resumed.saved_world_size,
            "world_size": rm.world_size,
            "seconds": resumed.seconds,
            "skipped": resumed.skipped,
            "restarts": trainer["restarts"],
            "generation": rm.generation,
            "incarnation": rm.incarnation,
            "time": time.time(),
        },
    )


def _step(job: Job, rm: RankManager, cursor: int, scale: float) -> tuple[torch.Tensor, Any]:
    """One optimizer step on this rank's micro-batches; returns its (accum,) losses and the
    gradient norm."""
    accum = job.geometry.accum_steps
    losses = torch.empty(accum, dtype=torch.float64, device=rm.device)  # no host syncs
    for micro in range(accum):
        idx = job.sampler.micro_batch(cursor, job.geometry, rm.rank, micro)
        x, y = (t.to(rm.device, non_blocking=True) for t in job.dataset.batch(idx))
        # Gradients reduce across ranks only on the last micro-batch of the step.
        sync = contextlib.nullcontext() if micro == accum - 1 else job.model.no_sync()
        with sync:
            _, loss = job.model(x, y)
            (loss * scale).backward()
        losses[micro] = loss.detach().double()
    grad_norm = job.model.clip_grad_norm_(job.clip)
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return losses, grad_norm


def run(cfg: TrainConfig, session: Session, job: Job) -> Outcome:
    """Resume if there is a checkpoint, then train up to ``cfg.steps``; see the module note."""
    rm, log, faults, preempt = session.rm, session.log, session.faults, session.preempt
    assert rm is not None and faults is not None and preempt is not None
    trainer: dict[str, Any] = {
        "step": 0,
        "cursor": 0,
        "restarts": 0,
        "world_size": rm.world_size,
        "config": _config_json(cfg),
    }
    if job.ckpt is not None:
        _resume(cfg, session, job, trainer)
    step, cursor = trainer["step"], trainer["cursor"]
    if session.watchdog is not None:
        session.watchdog.beat(step)
    # Deterministic engines average every micro-batch's gradient themselves.
    scale = 1.0 if job.deterministic_engine else 1.0 / job.geometry.accum_steps
    window: list[torch.Tensor] = []  # per step: (accum,) micro-batch losses of this rank
    blocking = 0.0  # seconds the loop spent inside checkpoint saves since the last log line
    out = Outcome()
    t_window = time.perf_counter()
    job.model.train()
    while step < cfg.steps:
        lr = job.scheduler.get_last_lr()[0]
        losses, grad_norm = _step(job, rm, cursor, scale)
        if session.ledger is not None:
            record = {
                "step": step + 1,
                "cursor": cursor,
                "ids": job.sampler.step_indices(cursor, cfg.global_batch),
                "restarts": trainer["restarts"],
                "incarnation": rm.incarnation,
                "time": time.time(),
            }
            session.ledger.write(json.dumps(record) + "\n")
            session.ledger.flush()
        step, cursor = step + 1, cursor + cfg.global_batch
        out.steps_run += 1
        trainer.update(step=step, cursor=cursor)
        if session.watchdog is not None:
            session.watchdog.beat(step)
        window.append(losses)

        # The step boundary: see [Note: one agreement per step boundary].
        faults.at_step_end(step)
        due = job.ckpt is not None and job.ckpt.due(step)
        stop, save_due = rm.agree_any(preempt.requested, due)
        last = step == cfg.steps
        if job.ckpt is not None and (save_due or stop or last):
            seconds = job.ckpt.save(step, trainer, block=stop or last)
            blocking += seconds
            log.write(
                f"checkpoint step {step} | blocking {seconds:.3f}s"
                + (" | async" if job.ckpt.in_flight() else ""),
                {"event": "checkpoint", "step": step, "blocking_s": seconds, "time": time.time()},
            )
        if step % cfg.log_every == 0 or last or stop:
            elapsed = time.perf_counter() - t_window
            out.loss = _log_window(
                cfg, rm, log, window, step, lr, grad_norm, blocking, trainer, elapsed
            )
            window, blocking, t_window = [], 0.0, time.perf_counter()
        faults.after_save(step)
        if stop:
            signalled = preempt.requested
            if not signalled:
                preempt.arm()  # bound this rank's exit too
            out.preempted = True
            out.exit_code = 0 if signalled else EXIT_PEER_PREEMPTED
            log.write(
                f"preempted at step {step}: checkpoint committed, exiting",
                {"event": "preempted", "step": step, "time": time.time()},
            )
            break
    if job.ckpt is not None:
        job.ckpt.close()
    return out


def _log_window(
    cfg: TrainConfig,
    rm: RankManager,
    log: MetricsLog,
    window: list[torch.Tensor],
    step: int,
    lr: float,
    grad_norm: torch.Tensor,
    blocking: float,
    trainer: dict[str, Any],
    elapsed: float,
) -> float:
    """The window's mean loss over every micro-batch of every rank, summed in the global
    micro-batch order (rank-major), so it is bitwise the same at any world size."""
    local = torch.stack(window)  # (steps, accum) float64, on the device
    if rm.world_size > 1:
        gathered = [torch.empty_like(local) for _ in range(rm.world_size)]
        dist.all_gather(gathered, local)
        local = torch.cat(gathered, dim=1)  # (steps, G): rank r's block is [r*accum, ...)
    total = 0.0
    for value in local.reshape(-1).cpu().tolist():
        total += value
    loss = total / local.numel()
    n = len(window)
    tokens_per_step = cfg.global_batch * cfg.block_size
    record = {
        "event": "step",
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens_per_s": tokens_per_step * n / elapsed,
        "s_per_step": elapsed / n,
        "ckpt_blocking_s": blocking,
        "restarts": trainer["restarts"],
        "generation": rm.generation,
        "world_size": rm.world_size,
        "time": time.time(),
    }
    log.write(
        f"step {step}/{cfg.steps} | loss {loss:.4f} | tokens/s {record['tokens_per_s']:.0f} | "
        f"s/step {record['s_per_step']:.3f} | grad_norm {record['grad_norm']:.3f} | lr {lr:.2e}"
        + (f" | ckpt blocking {blocking:.3f}s" if blocking else ""),
        record,
    )
    return loss


def start_record(cfg: TrainConfig, rm: RankManager, job: Job) -> dict:
    return {
        "event": "start",
        "config": dataclasses.asdict(cfg),
        "world_size": rm.world_size,
        "device": str(rm.device),
        "accum_steps": job.geometry.accum_steps,
        "n_params": job.n_params,
        "loss_floor": job.dataset.entropy_rate,
        "loss_uniform": job.dataset.uniform_loss,
        "generation": rm.generation,
        "restart_count": rm.info.restart_count,
        "incarnation": rm.incarnation,
        "deterministic_engine": job.deterministic_engine,
        "time": time.time(),
    }
