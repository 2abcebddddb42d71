"""The training entry's step loop; at every step boundary the ranks agree (one collective) on
"a rank was preempted" and "a time-based save is due", so all decide alike at the same step."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ftsdp import storage
from ftsdp.elastic import EXIT_PEER_PREEMPTED, BatchGeometry, RankManager
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._errors import JobError
from ftsdp.trainer._job import Job
from ftsdp.trainer._records import SavedRun, mismatch, refusal
from ftsdp.trainer._session import Session

EXIT_PEER_LOST = 1  # a failure: torchrun restarts the group (within --max-restarts)
# what a collective's error says when the process of another rank died (gloo's transport)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


@dataclass
class Outcome:
    loss: float = math.nan  # the last logged loss (of this run, or the checkpoint's record)
    loss_step: int | None = None  # the step it was logged at
    first_step: int = 0  # the step this run started from (the resumed one)
    steps_run: int = 0
    exit_code: int = 0
    preempted: bool = False


def _resume(cfg: TrainConfig, session: Session, job: Job, trainer: dict[str, Any]) -> int | None:
    """Load the newest usable checkpoint (its trainer keys as saved), log it, return its step
    (None: none); its records are checked again, as the resume may have fallen back."""
    rm, log, ckpt = session.rm, session.log, job.ckpt
    assert ckpt is not None
    template: dict[str, Any] = (
        dict(trainer) if job.saved is None else {k: None for k in job.saved.values}
    )
    try:
        resumed = ckpt.resume(template)
    except storage.StateMismatchError as e:  # e.g. a py: factory that changed the model
        first = str(e).splitlines()[0]
        raise JobError(
            f"the checkpoint at {cfg.checkpoint_url} does not match this model or optimizer: "
            f"{first[:400]}{'...' if len(first) > 400 else ''}; resume it with the model it was "
            "trained with or use another --checkpoint-url",
            report=rm.rank == 0,
        ) from None
    if resumed is None:
        return None
    saved = SavedRun(resumed.step, template)
    diffs = mismatch(saved, cfg, json.loads(job.records["model"]), json.loads(job.records["data"]))
    if diffs:
        raise JobError(refusal(cfg.checkpoint_url or "", resumed.step, diffs), report=rm.rank == 0)
    if job.scaler is not None and isinstance(template.get("grad_scaler"), str):
        job.scaler.load_state_dict(json.loads(template["grad_scaler"]))
    changed = _apply_schedule_flags(cfg, job, saved.config())
    if changed:
        log.write(
            f"resumed with {', '.join(changed)}: this run's values apply from step "
            f"{resumed.step + 1}",
            {"event": "flags_changed", "step": resumed.step, "changed": changed},
        )
    trainer.update(
        step=template["step"],
        cursor=template["cursor"],
        restarts=template["restarts"] + 1,
        world_size=rm.world_size,
        # the last logged loss; a checkpoint that predates the record has none
        loss=template.get("loss"),
        loss_step=template.get("loss_step"),
    )
    skipped = [s for s, _ in resumed.skipped]
    tier = "memory" if ckpt.memory_url and ckpt.resumed_from == ckpt.memory_url else "durable"
    # a converted checkpoint may be committed under another step than the one it trained
    other = f"committed as step {resumed.step}, " if template["step"] != resumed.step else ""
    log.write(
        f"resumed step {template['step']} ({other}saved at world {resumed.saved_world_size}, now "
        f"{rm.world_size}) in {resumed.seconds:.2f}s | the job's restart {trainer['restarts']}"
        + (" | from the memory tier" if tier == "memory" else "")
        + (f" | skipped unusable steps {skipped}" if skipped else ""),
        {
            "event": "resume",
            "step": resumed.step,
            "tier": tier,
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
    return resumed.step


_SCHEDULE_FLAGS = ("lr", "min_lr", "warmup", "weight_decay")


def _apply_schedule_flags(cfg: TrainConfig, job: Job, saved: dict[str, Any]) -> list[str]:
    """Put this run's learning-rate schedule and weight decay on the resumed optimizer (the load
    gave it the checkpoint's; the same values leave every bit as it was); the flags that differ
    from the saved run's."""
    sched, groups = job.scheduler, job.optimizer.param_groups
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    sched.base_lrs = [cfg.lr] * len(groups)
    for group, base, factor in zip(groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        group["initial_lr"], group["lr"] = base, base * factor(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
    groups[0]["weight_decay"] = cfg.weight_decay  # param_groups(): the decay group first
    return [
        f"--{k.replace('_', '-')} {getattr(cfg, k)} (saved {saved[k]})"
        for k in _SCHEDULE_FLAGS
        if k in saved and saved[k] != getattr(cfg, k)
    ]


def _step(
    job: Job, rm: RankManager, cursor: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step: this rank's micro-batches, then padding passes up to ``accum_steps``
    (``FSDP.padding()``); the (accum_steps,) losses (padding's zero) and the gradient norm."""
    g = job.geometry
    share, passes = g.share(rm.rank), g.accum_steps
    losses = torch.zeros(passes, dtype=torch.float64, device=rm.device)  # no host syncs
    for micro in range(passes):
        real = micro < share
        # A padding pass trains on one sample of the step; its gradient counts as zeros.
        idx = (
            job.sampler.micro_batch(cursor, g, rm.rank, micro)
            if real
            else [job.sampler.index(cursor)]
        )
        x, y = (t.to(rm.device, non_blocking=True) for t in job.dataset.batch(idx))
        # Gradients reduce across ranks only on the last pass of the step.
        sync = contextlib.nullcontext() if micro == passes - 1 else job.model.no_sync()
        with sync, contextlib.nullcontext() if real else job.model.padding():
            loss = job.loss(job.model, x, y)
            scaled = loss * scale
            (scaled if job.scaler is None else job.scaler.scale(scaled)).backward()
        if real:
            losses[micro] = loss.detach().double()
    if job.scaler is not None:
        job.scaler.unscale_(job.optimizer)  # the norm and the clip see the true gradients
    grad_norm = job.model.clip_grad_norm_(job.clip)
    if job.scaler is None:
        job.optimizer.step()
    else:  # skipped on every rank when any rank's gradients overflowed
        job.scaler.step(job.optimizer)
        job.scaler.update()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return losses, grad_norm


def _shares(g: BatchGeometry) -> str:
    """Micro-batches per rank: ``2`` when even, ``2-1`` when the ranks' shares differ."""
    most, least = g.share(0), g.share(g.world_size - 1)
    return str(most) if most == least else f"{most}-{least}"


def run(cfg: TrainConfig, session: Session, job: Job) -> int:
    """Log the start, train (:func:`train`), log the end; the worker's exit status."""
    rm, log, g = session.rm, session.log, job.geometry
    log.write(
        f"ftsdp.train | world {rm.world_size} | {rm.device} | {cfg.sharding_strategy} | "
        f"{job.n_params / 1e6:.2f}M params | global batch {cfg.global_batch} = micro "
        f"{cfg.micro_batch} x {g.micro_batches} over {rm.world_size} rank"
        f"{'s' if rm.world_size > 1 else ''} ({_shares(g)} each) | model {cfg.model}"
        + (f" ({cfg.mixed_precision})" if cfg.mixed_precision != "none" else "")
        + f" | {job.data_description}"
        + (f" | torchrun restart {rm.generation}" if rm.generation else ""),
        start_record(cfg, rm, job),
    )
    t0 = time.perf_counter()
    try:
        out = train(cfg, session, job)
    except Exception as e:
        if not peer_lost(e):
            raise
        return _peer_lost(session, job, e)
    wall = time.perf_counter() - t0
    record = {"event": "done", "steps": cfg.steps, "first_step": out.first_step, "wall_s": wall}
    record |= {"loss": out.loss, "loss_step": out.loss_step, "time": time.time()}
    if out.steps_run == 0 and out.first_step >= cfg.steps:  # a rerun of a finished job
        loss = "no loss recorded (a checkpoint of an older version)"
        if out.loss_step is not None:
            at = "" if out.loss_step == out.first_step else f" (step {out.loss_step})"
            loss = f"last logged loss {out.loss:.4f}{at}"
        log.write(
            f"already complete at step {out.first_step} (--steps {cfg.steps}): nothing to train"
            f" | {loss}",
            record,
        )
    elif not out.preempted:
        steps = f"steps {out.first_step}->{cfg.steps}" if out.first_step else f"{cfg.steps} steps"
        log.write(f"done | {steps} in {wall:.1f}s | final loss {out.loss:.4f}", record)
    if out.exit_code or out.preempted:
        return out.exit_code
    return 0 if math.isfinite(out.loss) or out.steps_run == 0 else 1


def train(cfg: TrainConfig, session: Session, job: Job) -> Outcome:
    """Resume if there is a checkpoint, then train up to ``cfg.steps``; see the module docstring."""
    rm, log, hook, preempt = session.rm, session.log, session.hook, session.preempt
    trainer: dict[str, Any] = {
        "step": 0,
        "cursor": 0,
        "restarts": 0,
        "world_size": rm.world_size,
        "config": json.dumps(dataclasses.asdict(cfg), sort_keys=True),
        "loss": None,  # the last logged loss and its step: a rerun of a finished job shows it
        "loss_step": None,
        **job.records,  # model, data: what is trained (_records)
    }
    out = Outcome()
    saved = job.saved
    if saved is not None and saved.step >= cfg.steps:  # finished: nothing to load nor train
        _finished(out, saved.step, saved.values.get("loss"), saved.values.get("loss_step"))
        if job.ckpt is not None:
            job.ckpt.close()
        return out
    resumed_from = None if job.ckpt is None else _resume(cfg, session, job, trainer)
    session.phases.mark("resumed")
    step, cursor = trainer["step"], trainer["cursor"]
    _finished(out, step, trainer["loss"], trainer["loss_step"])
    if session.watchdog is not None:
        session.watchdog.beat(step)
    # The gradient is the mean over the step's micro-batches at any world size. Deterministic
    # engines average the micro-batch gradients themselves; otherwise the reduction averages
    # over W ranks, so each micro-batch's loss weighs W/G (ranks' shares may differ).
    g = job.geometry
    scale = 1.0 if job.deterministic_engine else g.world_size / g.micro_batches
    window: list[torch.Tensor] = []  # per step: (accum_steps,) pass losses of this rank
    blocking = 0.0  # seconds the loop spent inside checkpoint saves since the last log line
    t_window = time.perf_counter()
    job.model.train()
    while step < cfg.steps:
        lr = float(job.scheduler.get_last_lr()[0])  # a float schedule (torch allows tensors)
        losses, grad_norm = _step(job, rm, cursor, scale)
        if out.steps_run == 0:  # the phases record, after the first step
            _log_phases(session, resumed_from)
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

        hook.at_step_end(step)  # then the agreement (module docstring)
        due = job.ckpt is not None and job.ckpt.due(step)
        stop, save_due = rm.agree_any(preempt.requested, due)
        last = step == cfg.steps
        logged = step % cfg.log_every == 0 or last or stop
        if logged:  # before the save, which records it (a collective: every rank, same steps)
            out.loss, out.loss_step = _window_loss(rm, job.geometry, window), step
            trainer.update(loss=out.loss, loss_step=step)
        if job.ckpt is not None and job.scaler is not None:
            trainer["grad_scaler"] = json.dumps(job.scaler.state_dict(), sort_keys=True)
        if job.ckpt is not None and (save_due or stop or last):
            seconds = job.ckpt.save(step, trainer, block=stop or last)
            blocking += seconds
            log.write(
                f"checkpoint step {step} | blocking {seconds:.3f}s"
                + (" | async" if job.ckpt.in_flight() else ""),
                {"event": "checkpoint", "step": step, "blocking_s": seconds, "time": time.time()},
            )
        elif job.ckpt is not None:
            blocking += job.ckpt.save_to_memory(step, trainer)  # when the memory tier is on
        if logged:  # the line and record of the window's steps
            elapsed = time.perf_counter() - t_window
            record = {
                "event": "step",
                "step": step,
                "loss": out.loss,
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens_per_s": cfg.global_batch * cfg.block_size * len(window) / elapsed,
                "s_per_step": elapsed / len(window),
                "ckpt_blocking_s": blocking,
                "restarts": trainer["restarts"],
                "generation": rm.generation,
                "world_size": rm.world_size,
                "time": time.time(),
            }
            log.write(
                f"step {step}/{cfg.steps} | loss {out.loss:.4f} | tokens/s "
                f"{record['tokens_per_s']:.0f} | s/step {record['s_per_step']:.3f} | grad_norm "
                f"{record['grad_norm']:.3f} | lr {lr:.2e}"
                + (f" | ckpt blocking {blocking:.3f}s" if blocking else ""),
                record,
            )
            window, blocking, t_window = [], 0.0, time.perf_counter()
        hook.after_save(step)
        if getattr(hook, "needs_commit", lambda _: False)(step):  # optional (StepHook)
            if job.ckpt is not None:
                job.ckpt.wait()
            hook.after_commit(step)  # type: ignore[attr-defined]
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


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank's process died (gloo)."""
    text = str(error)
    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError) and any(p in text for p in _PEER_LOST)
    )


def _peer_lost(session: Session, job: Job, error: BaseException) -> int:
    """One line instead of the traceback: what happened and where the restart resumes from (a
    save needs every rank); an orphaned rank says so instead and exits."""
    session.rm.exit_if_orphaned()
    session.preempt.cannot_save("a peer process was lost")
    session.rm.close(barrier=False)  # now, without the barrier: the peer will never reach it
    reason = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])  # gloo's source
    reason = reason.split(". ")[0].removesuffix(".")
    committed = {} if job.ckpt is None else job.ckpt.newest_committed()
    if job.ckpt is None:
        where = "step 0 (no --checkpoint-url)"
    elif committed:
        tier = max(committed, key=lambda t: (committed[t], t == "durable"))
        where = f"step {committed[tier]} ({tier})"
    else:
        where = "step 0 (nothing committed yet)"
    signalled = f" after {session.preempt.signal_name}" if session.preempt.requested else ""
    session.log.event(
        {"event": "error", "error": f"{type(error).__name__}: {error}"[:2000], "peer_lost": True},
        f"peer lost{signalled}: {reason}; exiting without saving, the restart resumes from {where}",
        logging.ERROR,
    )
    return EXIT_PEER_LOST


def _finished(out: Outcome, step: int, loss: float | None, loss_step: int | None) -> None:
    """Start ``out`` at ``step``, with the checkpoint's last logged loss (None: none)."""
    out.first_step = step
    if loss is not None and loss_step is not None:
        out.loss, out.loss_step = float(loss), int(loss_step)


def _log_phases(session: Session, resumed_from: int | None) -> None:
    """Mark the first step and write the ``phases`` record (ftsdp.trainer._phases)."""
    phases, rm = session.phases, session.rm
    phases.mark("first_step")
    record = phases.record(
        restart_count=rm.info.restart_count,
        generation=rm.generation,
        incarnation=rm.incarnation,
        world_size=rm.world_size,
        resumed_step=resumed_from,
    )
    session.log.write(phases.line(), record)


def _window_loss(rm: RankManager, g: BatchGeometry, window: list[torch.Tensor]) -> float:
    """The window's mean loss over every rank's micro-batches (padding left out), summed in the
    global micro-batch order: bitwise the same at any world size."""
    local = torch.stack(window)  # (steps, accum_steps) float64, on the device
    if rm.world_size > 1:
        gathered = [torch.empty_like(local) for _ in range(rm.world_size)]
        dist.all_gather(gathered, local)
        local = torch.cat(gathered, dim=1)  # (steps, W * accum_steps): rank r's passes
    real = [r * g.accum_steps + m for r in range(rm.world_size) for m in range(g.share(r))]
    local = local[:, real]  # (steps, G) in the global micro-batch order
    total = 0.0
    for value in local.reshape(-1).cpu().tolist():
        total += value
    return total / local.numel()


def start_record(cfg: TrainConfig, rm: RankManager, job: Job) -> dict:
    return {
        "event": "start",
        "config": dataclasses.asdict(cfg),
        "world_size": rm.world_size,
        "device": str(rm.device),
        "accum_steps": job.geometry.accum_steps,
        "n_params": job.n_params,
        "loss_floor": getattr(job.dataset, "entropy_rate", None),  # markov only
        "loss_uniform": getattr(job.dataset, "uniform_loss", None),
        "model": cfg.model,
        "data": cfg.data,
        "generation": rm.generation,
        "restart_count": rm.info.restart_count,
        "incarnation": rm.incarnation,
        "deterministic_engine": job.deterministic_engine,
        "time": time.time(),
    }
