"""What one training run works on, made by :func:`build` in an open session (docs/training.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

import ftsdp
from ftsdp import storage
from ftsdp.checkpoint._manager import CheckpointManager
from ftsdp.checkpoint._tiers import RootInUseError, root_problem
from ftsdp.elastic import BatchGeometry, GlobalSampler, RankManager
from ftsdp.examples.data import MarkovDataset, TokenDataset
from ftsdp.examples.gpt import param_groups
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._datasets import Data, open_data
from ftsdp.trainer._errors import JobError
from ftsdp.trainer._models import (
    BuiltModel,
    LossFn,
    ModelPlan,
    build_deferred,
    build_model,
    gpt_loss,
    has_dropout,
    init_sharded,
    model_positions,
    model_vocab,
    plan_init,
    plan_model,
)
from ftsdp.trainer._records import SavedRun, mismatch, peek, refusal
from ftsdp.trainer._session import Session, open_tensorboard

logger = logging.getLogger(__name__)
T = TypeVar("T")

# --mixed-precision: fp32 master weights and fp32 gradient reduction in every case.
MIXED_PRECISION = {
    "none": None,
    "bf16": ftsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "fp16": ftsdp.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def storage_options_from_env() -> dict[str, Any] | None:
    """``FTSDP_STORAGE_OPTIONS`` (a JSON object), or None; not a flag, as the config is saved in
    every checkpoint and secrets do not belong there (docs/elastic.md, "The training entry")."""
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

    model: ftsdp.FSDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    dataset: MarkovDataset | TokenDataset
    sampler: GlobalSampler
    geometry: BatchGeometry
    n_params: int
    loss: LossFn = gpt_loss  # (model, x, y) -> mean loss (``_models``)
    ckpt: CheckpointManager | None = None  # None without --checkpoint-url
    deterministic_engine: bool = False
    clip: float = math.inf  # max gradient norm; inf only measures it
    scaler: ftsdp.ShardedGradScaler | None = None  # --mixed-precision fp16
    # trainer values that say what is trained: "model" and "data", JSON strings (_records)
    records: dict[str, str] = field(default_factory=dict)
    saved: SavedRun | None = None  # the newest committed step's trainer values, when resuming
    data_description: str = ""


def on_every_rank(rm: RankManager, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; a :class:`JobError` on any rank is raised on every rank (rank 0
    reports one it met, a rank alone in meeting one reports it)."""
    error: JobError | None = None
    result: Any = None
    try:
        result = fn()
    except JobError as e:
        error = e
    failed, rank0_failed = rm.agree_any(error is not None, rm.rank == 0 and error is not None)
    if not failed:
        return result
    if error is None:
        raise JobError("the job could not be built on another rank (see its message)", report=False)
    error.report = rm.rank == 0 or not rank0_failed
    if error.report and rm.rank != 0:
        error.args = (f"rank {rm.rank}: {error}",)
    raise error


def memory_root(cfg: TrainConfig, url: str) -> str:
    """``--memory-url``, else ``/dev/shm/ftsdp-<uid>-<16 hex of the checkpoint root's hash>``:
    the same for every incarnation, other for another root (local: its absolute path) or user."""
    if cfg.memory_url:
        return cfg.memory_url
    path = url[len("file://") :] if url.startswith("file://") else url
    where = url if "://" in path else os.path.abspath(path)
    digest = hashlib.sha256(where.encode()).hexdigest()[:16]
    return os.path.join("/dev/shm", f"ftsdp-{os.geteuid()}-{digest}")


def drop_another_runs_memory(
    root: str, cfg: TrainConfig, model: dict[str, Any], data: dict[str, Any], rm: RankManager
) -> None:
    """Clear the memory tier at ``root`` when its newest step is another run's (else every resume
    refuses it); collective; a root not private to this user on some rank is left alone."""
    if any(rm.agree_any(root_problem(root) is not None)):
        return
    saved = peek(root, rank=rm.rank, world_size=rm.world_size)
    if saved is None:
        return
    diffs = mismatch(saved, cfg, model, data)
    if diffs and rm.rank == 0:
        logger.warning(
            "ftsdp.train: the memory tier %s holds step %d of another run (%s); clearing it",
            root,
            saved.step,
            "; ".join(diffs[:3]),
        )
        try:
            if root_problem(root) is None:  # again: the path could have changed since
                storage.catalog.clear_steps(root)
        except OSError as e:  # the resume then passes its steps over, or refuses them
            logger.warning("ftsdp.train: clearing the memory tier %s failed: %s", root, e)


def build(cfg: TrainConfig, session: Session) -> Job:
    """Data, the model (checked against the checkpoint root first), wrapped, its optimizer and
    schedule, the checkpoints; collective: a :class:`JobError` on any rank is raised on all."""
    rm = session.rm
    geometry = cfg.geometry(rm.world_size)
    logdir = cfg.tensorboard  # rank 0 writes; a missing package stops every rank
    if logdir:
        writer = on_every_rank(rm, lambda: open_tensorboard(logdir) if rm.rank == 0 else None)
        if writer is not None:
            session.log.attach(writer)
    data, plan = on_every_rank(rm, lambda: (open_data(cfg), plan_model(cfg)))
    url = session.hook.checkpoint_url(cfg.checkpoint_url) if cfg.checkpoint_url else None
    if cfg.checkpoint_url:
        refuse_a_root_lost_before(rm, cfg.checkpoint_url)
    storage_options = storage_options_from_env()
    saved = _check_saved_run(cfg, rm, url, storage_options, plan.record, data.record)
    built = on_every_rank(rm, lambda: _make_model(cfg, session, plan, data, saved, storage_options))
    n_params = sum(p.numel() for p in built.module.parameters())  # a tied weight counts once
    module = built.module
    # built on meta for --init-from only (which fills every parameter); a model a factory hands
    # over on meta without it is moved below and refused as before, never trained uninitialised
    deferred = built.init is not None and any(p.is_meta for p in module.parameters())
    if deferred:
        for m in module.modules():  # the buffers are real: to the device, as .to() would
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = b.to(rm.device)
    else:
        module = module.to(rm.device)
    model = ftsdp.FSDP(
        module,
        param_init_fn=_uninitialised if deferred else None,
        auto_wrap_policy=built.policy,
        sharding_strategy=ftsdp.ShardingStrategy[cfg.sharding_strategy],
        device_id=rm.device if rm.device.type == "cuda" else None,
        mixed_precision=MIXED_PRECISION[cfg.mixed_precision],
        deterministic=cfg.deterministic,
    )
    if built.init is not None:  # after sharding: each rank reads only its own shards
        init = built.init
        line = on_every_rank(rm, lambda: init_sharded(model, init, storage_options=storage_options))
        event = {"event": "init_from", "url": cfg.init_from, "ignored": False}
        session.log.write(line, {**event, "deferred": deferred})
    optimizer = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.lr)
    ckpt = None
    if url is not None:
        ckpt = CheckpointManager(
            url,
            model,
            optimizer,
            lr_scheduler=scheduler,
            every_steps=cfg.checkpoint_every or None,
            every_seconds=cfg.checkpoint_every_s or None,
            keep_last=cfg.keep_last,
            async_save=cfg.async_save,
            defer_copy=cfg.defer_copy,
            memory_url=memory_root(cfg, url) if cfg.memory_every else None,
            memory_every=cfg.memory_every or None,
            persister=cfg.persister,
            storage_options=storage_options,
            seed=cfg.seed,
            log=lambda line: session.log.event(
                {"event": "checkpoint_warning", "message": line}, line
            ),
        )
    return Job(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        dataset=data.dataset,
        sampler=GlobalSampler(len(data.dataset), seed=cfg.seed, shuffle=cfg.shuffle),
        geometry=geometry,
        n_params=n_params,
        loss=built.loss,
        ckpt=ckpt,
        deterministic_engine=cfg.deterministic,
        clip=cfg.grad_clip if cfg.grad_clip > 0 else math.inf,
        scaler=ftsdp.ShardedGradScaler(rm.device.type) if cfg.mixed_precision == "fp16" else None,
        records={
            "model": json.dumps(plan.record, sort_keys=True),
            "data": json.dumps(data.record, sort_keys=True),
        },
        saved=saved,
        data_description=data.description,
    )


def _uninitialised(module: torch.nn.Module) -> None:
    """``param_init_fn`` of a model ``--init-from`` fills: its parameters stay as allocated."""


def _lost_root_key(rm: RankManager, url: str) -> tuple[Any, str]:
    """The job's run-wide store (None: no store, nothing restarts this process) and the key
    that marks ``url`` as lost to another job."""
    return rm.store("lost-roots", run_wide=True), hashlib.sha256(url.encode()).hexdigest()


def remember_lost_root(rm: RankManager, url: str, error: RootInUseError) -> None:
    """Note in the job's store that this run lost ``url`` to another job, whose steps it found
    there (``error.steps``), so that the incarnations torchrun restarts refuse the root at once
    instead of resuming that job's steps (docs/elastic.md, "CheckpointManager"). A refusal
    without such steps (a lock, or this very refusal) notes nothing. Best effort: a failure is
    logged, and the restarted job is then refused at its next save as before."""
    if not error.steps:
        return
    try:
        store, key = _lost_root_key(rm, url)
        if store is not None:
            store.set(key, str(error)[:2000])
    except Exception as e:
        logger.warning("ftsdp.train: could not note the lost root %s for the restarts: %s", url, e)


def refuse_a_root_lost_before(rm: RankManager, url: str) -> None:
    """RootInUseError on every rank when an earlier incarnation of this run lost ``url`` to
    another job (:func:`remember_lost_root`), as any rank's store says (collective)."""
    try:
        store, key = _lost_root_key(rm, url)
        earlier = None if store is None or not store.check([key]) else store.get(key).decode()
    except Exception as e:  # the store's trouble is the watchdog's to report, not this check's
        logger.warning("ftsdp.train: could not ask the job's store about %s: %s", url, e)
        earlier = None
    (lost,) = rm.agree_any(earlier is not None)
    if lost:
        raise RootInUseError(
            f"an earlier incarnation of this run lost {url} to another job, so this restart "
            "does not resume that job's steps; stop this job, or start it again with a "
            "checkpoint URL of its own"
            + (f" (the earlier error: {earlier})" if earlier is not None else "")
        )


def _check_saved_run(
    cfg: TrainConfig,
    rm: RankManager,
    url: str | None,
    storage_options: dict[str, Any] | None,
    model: dict[str, Any],
    data: dict[str, Any],
) -> SavedRun | None:
    """The newest committed trainer values (JobError: another run's); clears a stale memory tier."""
    if url is None or cfg.checkpoint_url is None:
        return None
    saved = peek(url, storage_options=storage_options, rank=rm.rank, world_size=rm.world_size)
    if saved is not None:
        diffs = mismatch(saved, cfg, model, data)
        if diffs:  # every rank got the same values from rank 0
            raise JobError(refusal(cfg.checkpoint_url, saved.step, diffs), report=rm.rank == 0)
    if cfg.memory_every:
        drop_another_runs_memory(memory_root(cfg, url), cfg, model, data, rm)
    elif rm.local_rank == 0:  # one rank per machine: the tier is local
        note_unused_memory(memory_root(cfg, url))
    return saved


def note_unused_memory(root: str) -> None:
    """Say so when the memory tier an earlier run of this root kept on this machine is still
    there: without ``--memory-every`` it is neither loaded nor cleared, yet holds host memory."""
    if root_problem(root) is not None or not os.path.isdir(root):
        return  # not there, or not this user's own: another's business
    try:
        steps = storage.list_steps(root)
        held = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
        )
    except (OSError, storage.CheckpointError):
        return
    if steps:
        logger.warning(
            "ftsdp.train: the memory tier %s of an earlier run holds step %d (%.1f MB of host "
            "memory); without --memory-every this run neither loads nor clears it: add "
            "--memory-every N to resume from it (and keep using it), or remove the directory",
            root,
            steps[-1],
            held / 1e6,
        )


def _make_model(
    cfg: TrainConfig,
    session: Session,
    plan: ModelPlan,
    data: Data,
    saved: SavedRun | None,
    storage_options: dict[str, Any] | None,
) -> BuiltModel:
    """The unwrapped model (same on every rank), checked; ``--init-from`` (unless resuming)
    checked against it, to be read after wrapping (the model then built on meta if it can be)."""
    # Every generator a model or its code may draw from, the same on every rank: a run is
    # then reproducible from --seed alone (a resume restores them from the checkpoint).
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % (1 << 32))
    torch.manual_seed(cfg.seed)  # same init on every rank
    built = build_deferred(cfg, plan) if cfg.init_from and saved is None else None
    if built is None:
        torch.manual_seed(cfg.seed)
        built = build_model(cfg, plan)
    module = built.module
    vocab = model_vocab(module)
    if vocab is not None and data.max_token >= vocab:
        raise JobError(
            f"--data {cfg.data} holds token id {data.max_token} but the model embeds only "
            f"{vocab} ids; use a model with a vocabulary of at least {data.max_token + 1}"
            + (f" (--vocab-size {data.max_token + 1})" if plan.spec.kind == "gpt" else "")
        )
    positions = model_positions(module)
    if positions is not None and cfg.block_size > positions:
        raise JobError(
            f"--block-size {cfg.block_size} is longer than the {positions} positions the "
            f"model {cfg.model} is configured for; pass --block-size {positions} or less"
        )
    if cfg.deterministic and has_dropout(module):
        logger.warning(
            "ftsdp.train: the model has dropout (p > 0): its masks come from each rank's "
            "RNG, so --deterministic results depend on the world size; set dropout to 0 "
            "for bitwise reproducibility"
        )
    if cfg.init_from and saved is not None:
        session.log.write(
            f"--init-from {cfg.init_from} ignored: resuming from {cfg.checkpoint_url} "
            f"(step {saved.step})",
            {"event": "init_from", "url": cfg.init_from, "ignored": True},
        )
    elif cfg.init_from:  # checked here, on the unwrapped model; read once it is wrapped
        built.init = plan_init(module, cfg.init_from, storage_options=storage_options)
    return built
