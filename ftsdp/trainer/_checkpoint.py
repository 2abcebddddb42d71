"""``CheckpointManager``: periodic (async) saves, retention, and resume at any world size.

```python
ckpt = CheckpointManager(url, model, optimizer, lr_scheduler=sched, every_steps=50, keep_last=3)
resumed = ckpt.resume(trainer)          # newest committed step, resharded; None on a fresh start
for step in ...:
    ...
    if ckpt.due(step):                  # agree on it across ranks when it is time-based
        ckpt.save(step, trainer)        # async by default: returns once the shards are staged
ckpt.close()                            # waits for the last save; raises its error
```

The checkpoint of a step is one ``storage`` state (docs/format.md)::

    model.<param>                      FlatShard of every parameter / persistent buffer
    optim.state.<param>.<key>          FlatShard (exp_avg, exp_avg_sq) or whole tensor (step)
    optim.param_groups                 JSON: hyper-parameters and parameter names per group
    scheduler                          JSON: lr_scheduler.state_dict() (when given)
    rng                                JSON per rank: torch CPU, numpy and Python RNG states
    trainer.<key>                      the caller's JSON values (step, data cursor, ...)

[Note: resume agreement and fallback]
Rank 0 lists the committed steps and broadcasts them, so every rank tries the same steps in the
same order. ``storage.load`` is collective and all-or-nothing (every rank reads and verifies
before any rank writes into its target). After each attempt the ranks agree (all_reduce MAX) on
the outcome: loaded; unusable (corrupt, incomplete, I/O error: log loudly and try the previous
committed step); or a mismatch with this model/optimizer (raise: an older step would not help).

[Note: continuing after a fallback]
The steps a resume fell back past are newer than the one it loaded. ``storage.save`` refuses to
save behind newer committed steps (they would stay the newest: the next resume would load them
again, retention would keep them over the new saves), so the first save after such a resume
passes ``discard_newer=True``: once that step is committed, the committed steps newer than it
(the abandoned timeline, including an earlier commit of the same step number) are deleted.
Steps whose manifest is not even readable are not provably ours and stay; a later resume tries
them first, logs them as unusable again, and falls back to the newest save. Without a fallback
a newer committed step means another writer (a second job on the same root): the save's error
surfaces.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ftsdp import storage
from ftsdp.trainer import _checkpoint_state as cs

_OK, _FALLBACK, _FATAL = 0, 1, 2


@dataclass(frozen=True)
class ResumeInfo:
    """What :meth:`CheckpointManager.resume` loaded."""

    step: int
    saved_world_size: int
    seconds: float
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, why) tried first
    rng_restored: bool = True  # False: world size changed, RNGs reseeded per rank


class CheckpointManager:
    """Saves and restores a wrapped model (``sharded_state_dict`` /
    ``sharded_optim_state_dict``), its optimizer, an optional LR scheduler, the RNG states and
    the caller's trainer values under ``url`` (any fsspec URL).

    Args:
        every_steps / every_seconds: when :meth:`due` says a save is due (either may be None).
        keep_last / keep_every: retention after each commit (``storage.apply_retention``).
        async_save: :meth:`save` returns once the shards are staged; the upload and commit run
            in the background (errors surface at the next save, :meth:`wait` or :meth:`close`).
        seed: reseeds the RNGs per rank when the world size changed since the save.
        log: one-line messages (default: stderr); fallbacks are logged here, loudly.
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
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        save_options: storage.SaveOptions | None = None,
        load_options: storage.LoadOptions | None = None,
        seed: int = 0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"CheckpointManager: url={url!r} must be a non-empty str")
        for name, value in (("every_steps", every_steps), ("keep_last", keep_last)):
            if value is not None and value < 1:
                raise ValueError(f"CheckpointManager: {name}={value} must be >= 1 or None")
        if every_seconds is not None and every_seconds <= 0:
            raise ValueError(f"CheckpointManager: every_seconds={every_seconds} must be > 0")
        for method in ("sharded_state_dict", "sharded_optim_state_dict"):
            if not hasattr(model, method):
                raise ValueError(
                    f"CheckpointManager needs a model with {method}() (an ftsdp.FSDP), got "
                    f"{type(model).__name__}"
                )
        self.url = url
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save = async_save
        self.storage_options = storage_options
        self.process_group = process_group
        self.save_options, self.load_options = save_options, load_options
        self.seed = seed
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._pending: storage.SaveHandle | None = None
        self._last_save = time.monotonic()
        self.last_saved_step: int | None = None
        self._discard_newer = False  # the resume fell back: see [Note: continuing after a fallback]

    # -- the state ------------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _state(self, trainer: Mapping[str, Any]) -> dict[str, Any]:
        state: dict[str, Any] = {
            "model": cs.model_state(self.model),
            "optim": cs.optim_state(self.model, self.optimizer),
            "rng": cs.rng_state(),
            "trainer": dict(trainer),
        }
        if self.lr_scheduler is not None:
            state["scheduler"] = json.dumps(self.lr_scheduler.state_dict(), sort_keys=True)
        return state

    # -- saving ---------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether a periodic save is due at ``step`` on this rank (time-based decisions differ
        between ranks: agree on the answer, e.g. ``RankManager.agree_any``)."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        return (
            self.every_seconds is not None
            and time.monotonic() - self._last_save >= self.every_seconds
        )

    def save(self, step: int, trainer: Mapping[str, Any], *, block: bool = False) -> float:
        """Save ``step`` (collective). ``block`` (or ``async_save=False``) returns only once it
        is committed. A previous async save's error is raised here. Returns the seconds this
        call blocked the caller. Saving the step saved last is a no-op. The first save after a
        resume that fell back past unusable steps deletes the committed steps newer than it
        (see [Note: continuing after a fallback])."""
        if step == self.last_saved_step:
            if block:
                self.wait()
            return 0.0
        start = time.perf_counter()
        self.wait()  # one save at a time; surfaces the previous one's error
        handle = storage.save(
            self._state({**trainer}),
            self.url,
            step,
            process_group=self.process_group,
            async_save=self.async_save and not block,
            storage_options=self.storage_options,
            keep_last=self.keep_last,  # applied by the committing rank only
            keep_every=self.keep_every,
            options=self.save_options,
            discard_newer=self._discard_newer,
        )
        self._discard_newer = False  # once: after this save the newer steps are gone
        self._pending = handle  # even when already done: a failed save must still surface
        self._last_save = time.monotonic()
        self.last_saved_step = step
        return time.perf_counter() - start

    def in_flight(self) -> bool:
        """True while an async save is uploading or committing."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    # -- resuming -------------------------------------------------------------------------------
    def _agreed_steps(self) -> list[int]:
        rank, world = self._rank_world()
        msg: list[Any] = [None]
        if rank == 0:
            try:
                msg = [("ok", storage.list_steps(self.url, storage_options=self.storage_options))]
            except Exception as e:
                msg = [("error", f"{type(e).__name__}: {e}")]
        if world > 1:
            src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
            dist.broadcast_object_list(msg, src=src, group=self.process_group)
        kind, value = msg[0]
        if kind == "error":
            raise storage.CheckpointError(
                f"listing the checkpoints under {self.url} failed on rank 0: {value}"
            )
        return list(value)

    def _agree(self, code: int) -> int:
        if self._rank_world()[1] == 1:
            return code
        t = torch.tensor([code], dtype=torch.int32)
        if dist.get_backend(self.process_group) == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())

    def resume(self, trainer: dict[str, Any]) -> ResumeInfo | None:
        """Load the newest usable committed step into the model, optimizer, scheduler and RNGs,
        resharded to the current world size; fill ``trainer`` (a template with the same keys the
        saves used) in place. Returns None when nothing is committed yet (a fresh start)."""
        start = time.perf_counter()
        steps = self._agreed_steps()
        if not steps:
            return None
        cs.ensure_optimizer_state(self.optimizer)
        rank, world = self._rank_world()
        skipped: list[tuple[int, str]] = []
        for i, step in enumerate(reversed(steps)):
            target = self._state(trainer)
            error: BaseException | None = None
            code = _OK
            try:
                result = storage.load(
                    target,
                    self.url,
                    step,
                    process_group=self.process_group,
                    storage_options=self.storage_options,
                    options=self.load_options,
                )
            except (storage.StateMismatchError, storage.NewerFormatError) as e:
                error, code = e, _FATAL
            except (storage.CheckpointError, OSError) as e:
                error, code = e, _FALLBACK
            except Exception as e:  # still reach the agreement, or the other ranks would hang
                error, code = e, _FATAL
            agreed = self._agree(code)
            if agreed == _OK:
                break
            why = f"{type(error).__name__}: {error}" if error else "failed on another rank"
            if agreed == _FATAL:
                if error is not None:
                    raise error
                raise storage.StateMismatchError(
                    f"loading step {step} from {self.url} failed on another rank (state mismatch)"
                )
            skipped.append((step, why))
            older = list(reversed(steps))[i + 1 : i + 2]
            self._log(
                f"ftsdp: CHECKPOINT STEP {step} AT {self.url} IS UNUSABLE on rank {rank}: {why}; "
                + (f"falling back to step {older[0]}" if older else "no older committed step")
            )
        else:
            raise storage.CheckpointError(
                f"no usable checkpoint under {self.url}: committed steps {steps} all failed "
                f"({skipped[0][1]})"
            )
        trainer.update(target["trainer"])
        cs.restore_param_groups(
            self.optimizer,
            target["optim"]["param_groups"],
            cs.optim_state(self.model, self.optimizer)["param_groups"],
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(json.loads(target["scheduler"]))
        same_world = result.saved_world_size == world
        if same_world:
            cs.set_rng_state(target["rng"])
        else:
            cs.reseed(self.seed, step, rank)
        self.last_saved_step = step
        self._last_save = time.monotonic()
        self._discard_newer = bool(skipped)  # newer than ``step``: an abandoned timeline
        return ResumeInfo(
            step=step,
            saved_world_size=result.saved_world_size,
            seconds=time.perf_counter() - start,
            skipped=skipped,
            rng_restored=same_world,
        )

    def close(self) -> None:
        """Wait for the in-flight save and raise its error (idempotent)."""
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
