"""``CheckpointManager``: saves, retention, resume at any world size (docs/elastic.md)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ftsdp import storage
from ftsdp.checkpoint import _engines
from ftsdp.checkpoint import _state as cs
from ftsdp.checkpoint._snapshots import Snapshots
from ftsdp.checkpoint._tiers import Group, MemoryTier, Tier

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)
_OK, _FALLBACK, _FATAL = 0, 1, 2


@dataclass(frozen=True)
class ResumeInfo:
    """What :meth:`CheckpointManager.resume` loaded."""

    step: int
    saved_world_size: int
    seconds: float
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, why) tried first
    rng_restored: bool = True  # False: world size changed, RNGs reseeded per rank


@dataclass
class _Loaded:
    """One step a resume loaded: where from, the filled target, what it left out."""

    step: int
    tier: Tier
    target: dict[str, Any]
    saved_world_size: int
    stateless: list[str]  # parameters without optimizer state in the checkpoint
    skipped: list[tuple[int, str]]  # durable steps tried first


class CheckpointManager:
    """Saves a model, its optimizer, an optional LR scheduler, the RNG states and the caller's
    trainer values under ``url`` (any fsspec URL), and resumes them at any world size.

    Args:
        model: an ``ftsdp.FSDP``, torch FSDP2 or other DTensor model, ``DistributedDataParallel``
            or plain module (docs/elastic.md, "Any engine"); torch FSDP1 is refused.
        optimizer: an element-wise torch optimizer over the model's parameters, created after
            wrapping (a state tensor that cannot be resharded is refused when saving).
        every_steps / every_seconds: when :meth:`due` says a save is due (either may be None).
        keep_last / keep_every: retention after each commit (``storage.catalog.apply_retention``).
        async_save: :meth:`save` returns once the shards are staged (errors surface later).
        defer_copy: with ``async_save``, :meth:`save` returns before the shards are copied;
            ``optimizer.step()`` waits for the copy, other in-place changes :meth:`wait_snapshot`.
        memory_url / memory_every / memory_keep: the memory tier (docs/elastic.md).
        persister: with ``async_save``, a save copies this rank's state once into shared memory
            and a persister process writes and commits it (docs/elastic.md, "Snapshots through
            a persister"); the ranks must then be on one machine (else saves run in each rank's
            process). The memory tier then keeps its newest step only.
        save_options: how saves are laid out and written (retention: the manager's own).
        seed: reseeds the RNGs per rank when the world size changed since the save.
        log: one-line messages, fallbacks loudly (default: this module's logger, WARNING).
    """

    def __init__(
        self,
        url: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lr_scheduler: Any = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        async_save: bool = True,
        defer_copy: bool = True,
        memory_url: str | None = None,
        memory_every: int | None = None,
        memory_keep: int = 2,
        persister: bool = False,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        save_options: storage.SaveOptions | None = None,
        load_options: storage.LoadOptions | None = None,
        seed: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"CheckpointManager: url={url!r} must be a non-empty str")
        for name, value in (
            ("every_steps", every_steps),
            ("keep_last", keep_last),
            ("memory_every", memory_every),
            ("memory_keep", memory_keep),
        ):
            if value is not None and value < 1:
                raise ValueError(f"CheckpointManager: {name}={value} must be >= 1 or None")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError(f"CheckpointManager: every_seconds={every_seconds} must be > 0")
        self._log = log or logger.warning
        self._group = Group(process_group)
        self._durable = Tier(
            url,
            self._group,
            self._log,
            keep_last=keep_last,
            keep_every=keep_every,
            storage_options=storage_options,
            options=save_options,
        )
        self._memory = None
        if memory_url is not None:
            self._memory = MemoryTier(
                memory_url, self._durable, keep_last=memory_keep, options=save_options
            )
        self.engine = _engines.engine_for(model, optimizer)
        self._walk = cs.KeptWalk()  # the walk of the engine's tensors, kept between saves
        self.url, self.memory_url = url, memory_url
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.memory_every = (memory_every or 1) if memory_url else None
        self.async_save = async_save
        on = persister and async_save
        self._snap = Snapshots(self._durable, self._memory, save_options) if on else None
        self.defer_copy = async_save and defer_copy and self._snap is None
        self._defer_snapshot = async_save and defer_copy and self._snap is not None
        # the fence: optimizer.step() waits until the latest deferred save has copied the state
        self._fence = storage.saving.snapshot_fence(optimizer) if self.defer_copy else None
        if self._defer_snapshot:
            self._fence = optimizer.register_step_pre_hook(lambda *_: self.wait_snapshot())
        self.load_options, self.seed = load_options, seed
        self._last_save = time.monotonic()
        self.last_saved_step: int | None = None
        self.last_memory_step: int | None = None
        self.resumed_from: str | None = None  # the root the last resume loaded from

    def _tiers(self, off_too: bool = False) -> list[Tier]:
        """The durable tier, and the memory tier while it is on (``off_too``: also once off)."""
        memory = self._memory
        return [self._durable, *([memory] if memory is not None and (memory.on or off_too) else [])]

    def _state(
        self,
        trainer: Mapping[str, Any],
        tier: Tier,
        *,
        target: bool = False,
        copy_buffers: bool | None = None,
    ) -> dict:
        """The state to save to ``tier`` (its tensors' walk kept: ``KeptWalk``; buffers copied
        when ``copy_buffers``, by default for a deferred save), or, ``target``, dicts to load
        into."""
        if target:
            model: Any = self.engine.model_state()
            optim: dict[str, Any] = self.engine.optim_state()
        else:
            if copy_buffers is None:
                copy_buffers = self.defer_copy or self._defer_snapshot
            model, part, groups = self._walk.parts(self.engine, copy_buffers)
            optim = {"state": part, "param_groups": groups}
        state: dict[str, Any] = {
            "model": model,
            "optim": optim,
            "rng": cs.rng_state(),
            "trainer": dict(trainer),
            **tier.values(),
        }
        if self.lr_scheduler is not None:
            state["scheduler"] = _engines.scheduler_json(self.lr_scheduler.state_dict())
        return state

    def due(self, step: int) -> bool:
        """Whether a periodic save is due at ``step`` on this rank (agree on it across ranks)."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return (
            self.every_seconds is not None
            and time.monotonic() - self._last_save >= self.every_seconds
        )

    def save(self, step: int, trainer: Mapping[str, Any], *, block: bool = False) -> float:
        """Save ``step`` (collective); ``block`` (or ``async_save=False``) returns once it is
        committed. Raises a previous async save's error. Saving the step saved last is a no-op,
        unless that save failed (``Tier.failed``).
        Returns the seconds this call blocked the caller."""
        storage.format.check_step(step)
        if step == self.last_saved_step and step != self._durable.failed:
            if block:
                self.wait()
            return 0.0
        start = time.perf_counter()
        if not (self._snapshots() and self._snapshot(step, trainer, durable=True, block=block)):
            self._durable.save(  # waits for the previous save first, surfacing its error
                self._state(trainer, self._durable),
                step,
                async_save=self.async_save and not block,
                defer_copy=self.defer_copy and not block,
            )
        self._last_save = time.monotonic()
        self.last_saved_step = step
        return time.perf_counter() - start

    def memory_due(self, step: int) -> bool:
        """Whether a memory-tier save is due at ``step`` (the same answer on every rank)."""
        on = self._memory is not None and self._memory.on
        return on and self.memory_every is not None and step % self.memory_every == 0

    def save_to_memory(self, step: int, trainer: Mapping[str, Any]) -> float:
        """Save ``step`` to the memory tier when due (collective, each step); seconds blocked."""
        storage.format.check_step(step)
        if not self.memory_due(step) or step in (self.last_saved_step, self.last_memory_step):
            return 0.0
        assert self._memory is not None
        start = time.perf_counter()
        if not (self._snapshots() and self._snapshot(step, trainer, durable=False)):
            self._memory.save(self._state(trainer, self._memory), step, defer_copy=self.defer_copy)
            self.last_memory_step = step
        return time.perf_counter() - start

    def _snapshots(self) -> bool:
        """Whether saves go through the persister (collective the first time)."""
        return self._snap is not None and self._snap.start()

    def _snapshot(
        self, step: int, trainer: Mapping[str, Any], *, durable: bool, block: bool = False
    ) -> bool:
        """A save through the persister: to the durable root when ``durable``, to the memory
        tier when it is due. False: the persister could not take the state and is off (the
        caller saves in this process)."""
        assert self._snap is not None
        memory = self.memory_due(step) and step != self.last_memory_step
        extra = {}
        if memory and self._memory is not None:
            extra = {
                "memory_tier.durable_step": self._memory.values()["memory_tier"]["durable_step"]
            }
        # a deferred copy: buffers copied now
        state = self._state(trainer, self._durable, copy_buffers=self._defer_snapshot and not block)
        saved = self._snap.save(
            state,
            step,
            durable=durable,
            memory=memory,
            memory_values=extra,
            block=block,
            defer=self._defer_snapshot,
        )
        if saved is None:
            return False
        if memory and saved:
            self.last_memory_step = step
        return True

    def in_flight(self) -> bool:
        """True while an async save (durable or memory) is uploading or committing."""
        if self._snap is not None and self._snap.on:
            return self._snap.in_flight()
        return any(tier.in_flight() for tier in self._tiers())

    def wait_snapshot(self) -> None:
        """Block until the latest save copied this rank's state (before changing it in place)."""
        if self._snap is not None:
            self._snap.wait_copy()
        storage.saving.wait_snapshot()

    def prepare(self, trainer: Mapping[str, Any]) -> None:
        """Get the deferred saves ready (collective; :meth:`resume` or the first save calls it)."""
        if self.defer_copy:
            state = self._state(trainer, self._durable)
            for tier in self._tiers():
                tier.prepare(state)

    def newest_committed(self) -> dict[str, int]:
        """Each tier's newest known committed step (no wait, no collective): ``{"durable": 20}``."""
        if self._snap is not None and self._snap.on:
            self._snap.in_flight()  # reads the persister's answers
            return dict(self._snap.newest)
        tiers = zip(("durable", "memory"), self._tiers(), strict=False)
        return {name: step for name, tier in tiers if (step := tier.newest_committed()) is not None}

    def wait(self) -> None:
        """Block until the saves in flight commit; raise the durable one's error."""
        if self._snap is not None and self._snap.on:
            self._snap.wait()
        for tier in reversed(self._tiers()):
            tier.wait()

    def resume(self, trainer: dict[str, Any]) -> ResumeInfo | None:
        """Load the newest usable committed step of any tier at this world size; fill
        ``trainer`` (a template with the saved keys) in place. None: nothing to resume."""
        start = time.perf_counter()
        self.wait()  # the load writes into the saved tensors: no save may be reading them
        self._snapshots()  # memory steps a dead persister left complete are committed first
        candidates = self._candidates()
        self._durable.seen = {s for s, tier in candidates if tier is self._durable}
        loaded = None
        if candidates:
            had_state = {id(p) for p, entry in self.optimizer.state.items() if entry}
            kept = self._state_it_steps(had_state)
            cs.init_optimizer_state(self.optimizer)
            try:
                loaded = self._load_newest(candidates, trainer)
            finally:  # nothing loaded (or refused): undo init_optimizer_state
                if loaded is None:
                    for p in list(self.optimizer.state):
                        if id(p) not in had_state:
                            del self.optimizer.state[p]
                        elif id(p) in kept:
                            self.optimizer.state[p] = kept[id(p)]
        if loaded is None:
            self.prepare(trainer)
            return None
        rng_restored = self._restore(loaded, trainer)
        self._continue_from(loaded, candidates)
        self.prepare(trainer)
        seconds = time.perf_counter() - start
        return ResumeInfo(
            loaded.step, loaded.saved_world_size, seconds, loaded.skipped, rng_restored
        )

    def _state_it_steps(self, had_state: set[int]) -> dict[int, dict[str, Any]]:
        """Copies of the state ``init_optimizer_state`` is about to step (lr 0: Adam's moments
        and step still move), when some parameter has none (else it steps nothing)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not had_state or all(id(p) in had_state for p in params):
            return {}
        return {
            id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for p, entry in self.optimizer.state.items()
            if id(p) in had_state
        }

    def _candidates(self) -> list[tuple[int, Tier]]:
        """Every tier's committed steps, newest first, memory first at equal steps (collective)."""
        found = [(step, tier) for tier in self._tiers() for step in tier.steps()]
        return sorted(found, key=lambda c: (c[0], c[1].cache), reverse=True)

    def _load_newest(
        self, candidates: list[tuple[int, Tier]], trainer: dict[str, Any]
    ) -> _Loaded | None:
        """Load the first usable candidate; None when only unusable memory steps were there."""
        rank = self._group.rank_world()[0]
        durable = [s for s, tier in candidates if tier is self._durable]
        skipped: list[tuple[int, str]] = []
        for i, (step, tier) in enumerate(candidates):
            peek = tier.peek(step, durable)
            if peek.foreign is not None:
                self._log(peek.foreign)
                continue
            try:
                target = self._state(trainer, tier, target=True)
                if isinstance(peek.param_groups, str):  # before anything is loaded into place
                    cs.check_param_groups(
                        json.loads(peek.param_groups), json.loads(target["optim"]["param_groups"])
                    )
                stateless = _leave_out_stateless(target["optim"]["state"], peek.optim_names)
                result, why = tier.load(target, step, self.load_options), None
            except Exception as e:  # still reach the agreement, or the other ranks would hang
                why = e
            if self._agree(why, step, tier) == _OK:
                return _Loaded(step, tier, target, result.saved_world_size, stateless, skipped)
            what = f"{type(why).__name__}: {why}" if why else "failed on another rank"
            if not tier.cache:
                skipped.append((step, what))
            older = candidates[i + 1 : i + 2]
            self._log(
                f"ftsdp: CHECKPOINT STEP {step} AT {tier.url} IS UNUSABLE on rank {rank}: {what}; "
                + (
                    f"falling back to step {older[0][0]} at {older[0][1].url}"
                    if older
                    else "no older committed step"
                )
            )
        if durable:
            raise storage.CheckpointError(
                f"no usable checkpoint under {self.url}"
                + (f" or {self.memory_url}" if self.memory_url else "")
                + f": committed steps {sorted({c[0] for c in candidates})} all failed"
            )
        self._log(  # the memory tier's steps are not this run's
            f"ftsdp: no committed step under {self.url} and none usable in the memory "
            f"tier {self.memory_url}: starting from scratch"
        )
        return None

    def _agree(self, error: BaseException | None, step: int, tier: Tier) -> int:
        """Every rank's agreed load outcome: ``_OK``, ``_FALLBACK`` or ``_FATAL`` (raised here)."""
        unusable = isinstance(error, storage.CheckpointError | OSError) and not isinstance(
            error, storage.StateMismatchError | storage.NewerFormatError
        )
        code = _OK if error is None else _FALLBACK if unusable else _FATAL
        agreed = self._group.agree(min(code, _FALLBACK) if tier.cache else code)
        if agreed == _FATAL:
            if error is not None:
                raise error
            raise storage.StateMismatchError(
                f"loading step {step} from {tier.url} failed on another rank (state mismatch)"
            )
        return agreed

    def _restore(self, loaded: _Loaded, trainer: dict[str, Any]) -> bool:
        """Put a loaded step into place; whether the RNGs were restored (else reseeded)."""
        target = loaded.target
        trainer.update(target["trainer"])
        self.engine.load(target["model"], target["optim"])
        params = self.engine.params_by_name()
        for name in loaded.stateless:  # no state when saved: none now either
            self.optimizer.state.pop(params[name], None)
        cs.restore_param_groups(
            self.optimizer,
            target["optim"]["param_groups"],
            self.engine.optim_state()["param_groups"],
        )
        if self.lr_scheduler is not None:
            sched = self.lr_scheduler
            sched.load_state_dict(_engines.scheduler_state(target["scheduler"], sched.state_dict()))
        rank, world = self._group.rank_world()
        if loaded.saved_world_size == world:
            cs.set_rng_state(target["rng"])
            return True
        cs.reseed(self.seed, loaded.step, rank)
        return False

    def _continue_from(self, loaded: _Loaded, candidates: list[tuple[int, Tier]]) -> None:
        """Saves go on from the loaded step (after a fallback, discarding the newer steps)."""
        durable = [s for s, tier in candidates if tier is self._durable and s <= loaded.step]
        self.last_saved_step = max(durable, default=None)
        self._durable.newest = self.last_saved_step
        self._durable.discard_newer = bool(loaded.skipped)
        self._durable.resumed = loaded.step
        self.resumed_from = loaded.tier.url
        self._last_save = time.monotonic()

    def close(self) -> None:
        """Wait for the in-flight saves, raising the durable one's error; take the fence off and
        clear the memory tier (collective, idempotent; a failed job skips it, for its restart).
        A save after it copies the state before it returns (no fence is left to wait for a
        deferred copy)."""
        try:
            self.wait()
        finally:
            self._unfence()
            if self._snap is not None:
                self._snap.close()
        for tier in self._tiers(off_too=True):
            tier.close()  # (a memory tier turned off still lets go of what its saves kept)

    def _unfence(self) -> None:
        """Take the fence off the optimizer; saves from here on copy before they return."""
        if self._fence is not None:
            self._fence.remove()
            self._fence = None
        self.defer_copy = self._defer_snapshot = False

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        """:meth:`close` when the block ended normally; left by an exception, what a crash does:
        no wait, nothing cleared, the fence kept (docs/elastic.md, "CheckpointManager")."""
        if exc_type is None:
            self.close()
            return
        if self.in_flight():
            self._log(
                "ftsdp: leaving CheckpointManager on an exception with a save in flight: not "
                "waited for (it commits only if this process lives on); the memory tier is kept "
                "for the restart"
            )


def _leave_out_stateless(state: dict[str, dict[str, Any]], saved: set[str] | None) -> list[str]:
    """Remove (and return) the parameters with no ``optim.state.*`` name in ``saved`` (None: keep
    all); one with some keys stays. No parameter's name is another's plus a dot."""
    if saved is None:
        return []
    heads: set[str] = set()  # every dotted prefix of every saved name, after "optim.state."
    for n in saved:
        parts = n.split(".")[2:]
        heads.update(".".join(parts[:i]) for i in range(1, len(parts)))
    gone = [name for name, entry in state.items() if entry and name not in heads]
    for name in gone:
        del state[name]
    return gone
