"""``CheckpointManager``: periodic (async) saves, retention, and resume at any world size.

```python
ckpt = CheckpointManager(url, model, optimizer, lr_scheduler=sched, every_steps=50, keep_last=3)
resumed = ckpt.resume(trainer)          # newest committed step, resharded; None on a fresh start
for step in ...:
    ...
    if ckpt.due(step):                  # agree on it across ranks when it is time-based
        ckpt.save(step, trainer)        # returns at once; optimizer.step() waits for the copy
ckpt.close()                            # waits for the last save; raises its error
```

The model may be an ``ftsdp.FSDP``, a torch FSDP2 (``fully_shard``) or other DTensor model, a
``DistributedDataParallel``, or a plain module; the optimizer any element-wise torch optimizer
(AdamW, SGD with momentum, Adagrad, ...). ``_engines.py`` has one adapter per kind of model. The
checkpoint of a step is one ``storage`` state (docs/format.md), the same for every kind::

    model.<param>                      the parameter / persistent buffer: FlatShard (ftsdp.FSDP),
                                       DTensor (FSDP2) or whole tensor (DDP, plain module)
    optim.state.<param>.<key>          sharded like its parameter (exp_avg, momentum_buffer, sum),
                                       whole when 0-dim (step), JSON when not a tensor
    optim.param_groups                 JSON: hyper-parameters and parameter names per group
    scheduler                          JSON: lr_scheduler.state_dict() (when given)
    rng                                JSON per rank: torch CPU, numpy and Python RNG states
    trainer.<key>                      the caller's JSON values (step, data cursor, ...)
    memory_tier.durable_step           memory tier only: see [Note: whose memory tier]

[Note: resume agreement and fallback]
Rank 0 lists the committed steps and broadcasts them, so every rank tries the same steps in the
same order. ``storage.load`` is collective and all-or-nothing (every rank reads and verifies
before any rank writes into its target). After each attempt the ranks agree (all_reduce MAX) on
the outcome: loaded; unusable (corrupt, incomplete, I/O error: log loudly and try the previous
committed step); or a mismatch with this model/optimizer (raise: an older step would not help).

[Note: the optimizer state to load into]
``storage.load`` fills a template in place, so the optimizer's state must exist first: a fresh
optimizer takes one step with zero gradients and lr 0 (``init_optimizer_state``). A parameter
that had no state when the step was saved (a save before the first step, a parameter no step
reached) must end without state again: rank 0 reads the step's manifest and broadcasts the
names of its optimizer state; a template entry of a parameter with no saved state is left out of
the load and the parameter's state is dropped afterwards.

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

[Note: the memory tier]
Durable saves cost an upload and are periodic; a worker killed between two of them loses the
steps since the last one. With ``memory_url`` (host shared memory, ``/dev/shm``: it outlives the
worker process, not the machine) the manager also saves every ``memory_every`` steps there,
with the same format, plan, checksums and commit as a durable save (the root is just another
storage root), keeping ``memory_keep`` steps. A restart on the same machine resumes from the
newest usable step of either tier (memory first at equal steps) and falls back across tiers
like within one; a memory step that does not match this model (another run's tier, left by a job
killed before ``close``) is passed over like an unusable one, and when nothing durable is left
the run starts from scratch. Memory saves go to another root than the durable ones, so storage runs them
in a lane of their own (see [Note: one lane per root] in storage/saving/_save.py): a slow durable
upload holds neither them nor the optimizer's fence. The first memory save after a resume
discards newer memory steps (an abandoned timeline). A failed memory save is logged, not raised.
Resume compares the ranks' machines (host name and boot id): on one machine the tier is one
root every rank sees; on several see [Note: the memory tier on several machines]. ``close`` (the
end of a run, or a preemption after its durable save) clears the tier; a failed run leaves it
for its restart.

[Note: the memory tier on several machines]
With ranks on several machines no root is seen by every rank, so memory saves pass
``node=<this machine>`` to ``storage.save``: each machine's ranks write into ``memory_url`` as
that machine sees it, the step is committed through collectives, and each machine also keeps a
replica of the previous machine's objects (see [Note: node-local roots] in storage/saving/_nodes.py).
``resume`` first calls ``storage.restore_on_nodes``, which completes on every machine of the new
job the newest step they hold together (a lost machine's objects come from its successor's
replica), and offers that one step as the memory candidate; without one the durable tier is
used. ``close`` clears the root on every machine. ``$FTSDP_NODE`` overrides the machine's
identity, so that tests can run several "machines" on one (each with its own ``memory_url``).
Over a process group that is not the whole job the tier is off on several machines (storage's
own gloo group spans the job). The mode is decided in ``resume``; a manager that saves to memory
without resuming first treats the ranks as on one machine.

[Note: whose memory tier]
The memory tier outlives the processes that wrote it, so a start may find another run's steps
there: a job killed before ``close`` (kill -9, a lost allocation) leaves them, and ftsdp.train's
default memory root is derived from the checkpoint root's path, so a run started over on a
re-created root meets them. A step of another model does not load and is passed over. One of the
same model would load, silently continuing the deleted run; so each memory save records the
newest durable step known to be committed when it was taken (``memory_tier.durable_step``, -1
before the first), and resume passes over a memory step that followed a durable step later than
every step under the checkpoint root. A memory step taken before any durable commit cannot be
told apart and is used. The first memory save of a run discards the memory steps newer than it,
so stale steps are met only before it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ftsdp import storage
from ftsdp.checkpoint import _engines
from ftsdp.checkpoint import _state as cs

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


NODE_ENV = "FTSDP_NODE"  # overrides _machine(): e.g. to simulate several nodes on one machine


def _machine() -> str:
    """This machine, as far as shared memory goes: host name and boot id, or the value of
    ``$FTSDP_NODE`` when set (see [Note: the memory tier on several machines])."""
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class CheckpointManager:
    """Saves and restores a model, its optimizer, an optional LR scheduler, the RNG states and
    the caller's trainer values under ``url`` (any fsspec URL), and resumes them at any world
    size.

    Args:
        model: an ``ftsdp.FSDP``, a torch FSDP2 (``fully_shard``) or other DTensor model, a
            ``DistributedDataParallel``, or a plain module (one process, or replicated by hand:
            identical on every rank, saved once). torch FSDP1 is refused.
        optimizer: any element-wise torch optimizer over the model's parameters (created after
            wrapping): state tensors shaped like their parameter's shard, 0-dim tensors, JSON
            values. A state tensor that cannot be resharded is refused when saving, naming it.
        every_steps / every_seconds: when :meth:`due` says a save is due (either may be None).
        keep_last / keep_every: retention after each commit (``storage.apply_retention``).
        async_save: :meth:`save` returns once the shards are staged; the upload and commit run
            in the background (errors surface at the next save, :meth:`wait` or :meth:`close`).
        defer_copy: with ``async_save``, :meth:`save` returns before the shards are even copied
            (milliseconds): a background thread copies them while the next forward and backward
            run, and the optimizer's ``step()`` waits for that copy (a step pre-hook installed
            here). The model's buffers, which forward may change in place (BatchNorm), are
            copied before :meth:`save` returns. Change saved tensors in place outside
            ``optimizer.step()`` (an EMA, weight clipping) only after :meth:`wait_snapshot`. See
            [Note: deferred snapshots] in ``storage/saving/_save.py``.
        memory_url / memory_every / memory_keep: a second, fast tier (see [Note: the memory
            tier]): :meth:`save_to_memory` saves every ``memory_every`` steps under
            ``memory_url`` (host shared memory, e.g. ``/dev/shm/...``), keeping the newest
            ``memory_keep`` steps; :meth:`resume` takes the newest usable step of either tier;
            :meth:`close` clears the tier. With ranks on several machines each machine keeps its
            own root (the same ``memory_url`` as it sees it) and a replica of another's (see
            [Note: the memory tier on several machines]).
        save_options: how saves are laid out and written. ``reuse_retired`` (None: on for the
            memory tier only) lets a save overwrite the objects of the step retention just
            retired instead of writing new files, where nobody else holds them (tmpfs roots;
            see docs/format.md for what it cannot see); :meth:`close` removes what the last
            retention left.
        seed: reseeds the RNGs per rank when the world size changed since the save.
        log: one-line messages (default: the ``ftsdp.checkpoint._manager`` logger, at WARNING);
            fallbacks are logged here, loudly.
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
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
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
        if memory_url is not None and _place(memory_url) == _place(url):
            raise ValueError(
                f"CheckpointManager: memory_url={memory_url!r} is the checkpoint root itself "
                f"({url!r}): the memory tier keeps only memory_keep steps and close() clears it, "
                "which would delete the durable checkpoints; give it a root of its own (e.g. "
                "under /dev/shm)"
            )
        self.engine = _engines.engine_for(model, optimizer)
        self.url = url
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.keep_last, self.keep_every = keep_last, keep_every
        if memory_every is not None and memory_every < 1:
            raise ValueError(f"CheckpointManager: memory_every={memory_every} must be >= 1")
        if memory_keep < 1:
            raise ValueError(f"CheckpointManager: memory_keep={memory_keep} must be >= 1")
        self.async_save = async_save
        self.memory_url = memory_url
        self.memory_every = (memory_every or 1) if memory_url else None
        self.memory_keep = memory_keep
        self._memory_on = memory_url is not None
        self._memory_node: str | None = None  # ranks on several machines: this rank's node
        self._memory_discard_newer = True  # the tier follows this run's timeline
        self.last_memory_step: int | None = None
        self.resumed_from: str | None = None  # the root the last resume loaded from
        self._pending_memory: storage.SaveHandle | None = None  # the memory tier's lane
        self.defer_copy = async_save and defer_copy
        # the fence: optimizer.step() waits until the latest deferred save has copied the state
        self._fence = storage.snapshot_fence(optimizer) if self.defer_copy else None
        self.storage_options = storage_options
        self.process_group = process_group
        self.save_options, self.load_options = save_options, load_options
        self.seed = seed
        self._log = log or logger.warning
        self._pending: storage.SaveHandle | None = None
        self._durable_base: int | None = None  # the newest durable step known to be committed
        self._last_save = time.monotonic()
        self.last_saved_step: int | None = None
        self._saved_here = False  # a save of this manager was started (not just a resume)
        self._discard_newer = False  # the resume fell back: see [Note: continuing after a fallback]

    # -- the state ------------------------------------------------------------------------------
    def _rank_world(self) -> tuple[int, int]:
        if not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _state(
        self, trainer: Mapping[str, Any], *, target: bool = False, memory: bool = False
    ) -> dict[str, Any]:
        """The state to save, or with ``target`` the one to load into (aliasing everything);
        ``memory``: of the memory tier (see [Note: whose memory tier])."""
        # Saving: the parts unchanged since the last save as the same storage.KeptState objects
        # (see [Note: kept parts of a state] in storage); a load target: dicts of its own.
        model = self.engine.model_state(kept=not target)
        if self.defer_copy and not target:  # see [Note: buffers change in forward] (_engines)
            model = self.engine.copy_buffers(model)
        state: dict[str, Any] = {
            "model": model,
            "optim": self.engine.optim_state(kept=not target),
            "rng": cs.rng_state(),
            "trainer": dict(trainer),
        }
        if self.lr_scheduler is not None:
            state["scheduler"] = json.dumps(self.lr_scheduler.state_dict(), sort_keys=True)
        if memory:
            base = self._durable_base
            state["memory_tier"] = {"durable_step": -1 if base is None else base}
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
        self._wait_durable()  # one durable save at a time; surfaces the previous one's error
        handle = storage.save(
            self._state({**trainer}),
            self.url,
            step,
            process_group=self.process_group,
            async_save=self.async_save and not block,
            defer_copy=self.defer_copy and not block,
            storage_options=self.storage_options,
            keep_last=self.keep_last,  # applied by the committing rank only
            keep_every=self.keep_every,
            options=self.save_options,
            discard_newer=self._discard_newer,
        )
        self._discard_newer = False  # once: after this save the newer steps are gone
        self._saved_here = True
        self._pending = handle  # even when already done: a failed save must still surface
        self._last_save = time.monotonic()
        self.last_saved_step = step
        return time.perf_counter() - start

    # -- the memory tier ------------------------------------------------------------------------
    def memory_due(self, step: int) -> bool:
        """Whether a memory-tier save is due at ``step`` (the same answer on every rank)."""
        return self._memory_on and self.memory_every is not None and step % self.memory_every == 0

    def save_to_memory(self, step: int, trainer: Mapping[str, Any]) -> float:
        """Save ``step`` to the memory tier if it is due there and not saved already (collective:
        every rank calls it at every step). It runs beside a durable upload still in flight
        (another root: storage's lanes) and waits only for the previous memory save (to shared
        memory: milliseconds). A memory save that fails is logged, not raised: the tier is a
        cache, the durable saves go on. Returns the seconds the caller was blocked."""
        if not self.memory_due(step) or step in (self.last_saved_step, self.last_memory_step):
            return 0.0
        start = time.perf_counter()
        self._wait_memory()
        assert self.memory_url is not None
        try:
            self._durable_committed()
            self._pending_memory = storage.save(
                self._state({**trainer}, memory=True),
                self.memory_url,
                step,
                process_group=self.process_group,
                async_save=True,
                defer_copy=self.defer_copy,
                keep_last=self.memory_keep,
                options=self._memory_options(),
                discard_newer=self._memory_discard_newer,
                node=self._memory_node,
            )
        except storage.CheckpointError as e:  # the previous one's error, seen by storage
            self._log(f"ftsdp: a save to the memory tier {self.memory_url} failed: {e}")
        self._memory_discard_newer = False
        self.last_memory_step = step
        return time.perf_counter() - start

    def _memory_options(self) -> storage.SaveOptions:
        """The memory tier's save options: the manager's, overwriting retired objects unless
        they say otherwise (the tier is the manager's own root, which nothing else reads)."""
        options = self.save_options or storage.SaveOptions()
        if options.reuse_retired is None:
            options = replace(options, reuse_retired=True)
        return options

    def _wait_memory(self) -> None:
        pending, self._pending_memory = self._pending_memory, None
        if pending is None:
            return
        try:
            pending.wait()
        except Exception as e:
            self._log(f"ftsdp: a save to the memory tier {self.memory_url} failed: {e}")

    def in_flight(self) -> bool:
        """True while an async save (durable or memory) is uploading or committing."""
        return any(p is not None and not p.done() for p in (self._pending, self._pending_memory))

    def wait_snapshot(self) -> None:
        """Block until the latest save has copied this rank's state: needed before changing a
        saved tensor in place outside ``optimizer.step()`` (which waits by itself)."""
        storage.wait_snapshot()

    def prepare(self, trainer: Mapping[str, Any]) -> None:
        """Get the deferred saves ready (collective, once): storage's own process group and the
        host memory of this rank's share of the state as it is now (after a resume: all of it;
        on a fresh start the optimizer's state does not exist yet, and the first save adds it).
        :meth:`resume` calls it; without either, the first save does it."""
        if not self.defer_copy:
            return
        state = self._state({**trainer})
        roots = [(self.url, self.storage_options)]
        if self.memory_url is not None and self._memory_on:
            roots.append((self.memory_url, None))
        for url, options in roots:  # each root has its own group and memory (storage's lanes)
            storage.prepare_save(
                state,
                url,
                process_group=self.process_group,
                storage_options=options,
                options=self.save_options,
            )

    def wait(self) -> None:
        """Block until the in-flight saves (durable and memory) are committed; raise the durable
        one's error (a memory save's is logged)."""
        self._wait_memory()
        self._wait_durable()

    def _wait_durable(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            self._durable_base = pending.step

    def _durable_committed(self) -> None:
        """Note the durable step that is committed by now, if the latest one is (its error, if
        any, is raised later by :meth:`wait`)."""
        pending = self._pending
        if pending is not None and pending.done():
            try:
                pending.wait(0)
            except Exception:
                return
            self._durable_base = pending.step

    # -- resuming -------------------------------------------------------------------------------
    def _from_rank0(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, its result on every rank (rank 0 must not raise)."""
        rank, world = self._rank_world()
        msg: list[Any] = [compute() if rank == 0 else None]
        if world > 1:
            src = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
            dist.broadcast_object_list(msg, src=src, group=self.process_group)
        return msg[0]

    def _agreed_steps(self, memory: bool = False) -> list[int]:
        url = self.memory_url if memory else self.url
        assert url is not None  # memory=True only with a memory tier
        options = None if memory else self.storage_options

        def listing() -> tuple[str, Any]:
            try:
                return "ok", storage.list_steps(url, storage_options=options)
            except FileNotFoundError:
                return "ok", []
            except Exception as e:
                return "error", f"{type(e).__name__}: {e}"

        kind, value = self._from_rank0(listing)
        if kind == "error":
            if memory:  # a cache: without it, the durable steps
                self._log(f"ftsdp: listing the memory tier {url} failed on rank 0: {value}")
                return []
            raise storage.CheckpointError(
                f"listing the checkpoints under {url} failed on rank 0: {value}"
            )
        return list(value)

    def _memory_shared(self) -> bool:
        """Whether the memory tier is usable; decides how: every rank sees rank 0's tier (the
        same machine: host name and boot id), or each machine has its own, with a replica of
        another's (see [Note: the memory tier on several machines]). Over a subgroup of a job
        on several machines the tier is turned off."""
        if not self._memory_on:
            return False
        here = _machine()
        same = self._from_rank0(lambda: here) == here
        self._memory_node = None
        if self._agree(_OK if same else _FALLBACK) != _OK:
            group = self.process_group
            if group is not None and dist.get_world_size(group) != dist.get_world_size():
                self._log(
                    f"ftsdp: the memory tier {self.memory_url} is off: the ranks are on more "
                    "than one machine and the process group is a subgroup (node-local memory "
                    "tiers need every rank of the job; only durable checkpoints are used)"
                )
                self._memory_on = False
            else:
                self._memory_node = here
        return self._memory_on

    def _peek(self, step: int, url: str) -> tuple[set[str] | None, Any]:
        """Read by rank 0 from step ``step``'s manifest: the names of its optimizer state (None
        when the manifest cannot be read: the load reports why; see [Note: the optimizer state
        to load into]) and, for a memory step, the durable step it followed (see [Note: whose
        memory tier])."""

        def peek() -> tuple[list[str] | None, Any]:
            try:
                options = self.storage_options if url == self.url else None
                m = storage.read_manifest(url, step, storage_options=options)
            except Exception:
                return None, None
            found = {*m.tensors, *m.values, *(k for values in m.rank_values for k in values)}
            names = sorted(n for n in found if n.startswith("optim.state."))
            return names, m.values.get("memory_tier.durable_step")

        names, base = self._from_rank0(peek)
        return (None if names is None else set(names)), base

    def _another_runs(self, step: int, base: Any, candidates: list[tuple[int, str]]) -> bool:
        """Whether memory step ``step``, saved after durable step ``base`` had committed, is
        another run's: the checkpoint root holds no step that late (see [Note: whose memory
        tier]). Logs why; the same answer on every rank (``base`` and ``candidates`` are rank
        0's)."""
        if not isinstance(base, int) or base < 0:
            return False  # saved before any durable commit (or by an older version)
        durable = [s for s, url in candidates if url == self.url]
        if durable and max(durable) >= base:
            return False
        self._log(
            f"ftsdp: CHECKPOINT STEP {step} AT {self.memory_url} IS ANOTHER RUN'S: it was saved "
            f"after durable step {base}, and {self.url} holds "
            + (f"only steps up to {max(durable)}" if durable else "no step")
            + " (the checkpoint root was replaced); passing it over"
        )
        return True

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
        self.wait()  # the load writes into the saved tensors: no save may be reading them
        candidates = [(step, self.url) for step in self._agreed_steps()]
        if self.memory_url is not None and self._memory_shared():
            if self._memory_node is None:
                memory = self._agreed_steps(memory=True)
            else:  # one step, made whole on every node (or none)
                restored = storage.restore_on_nodes(
                    self.memory_url, node=self._memory_node, process_group=self.process_group
                )
                memory = [] if restored is None else [restored]
            candidates += [(step, self.memory_url) for step in memory]
        # newest first; at equal steps memory first (faster to read)
        candidates.sort(key=lambda c: (c[0], c[1] == self.memory_url), reverse=True)
        if not candidates:
            self.prepare(trainer)
            return None
        had_state = {id(p) for p, entry in self.optimizer.state.items() if entry}
        cs.init_optimizer_state(self.optimizer)
        rank, world = self._rank_world()
        skipped: list[tuple[int, str]] = []
        for i, (step, url) in enumerate(candidates):
            saved, base = self._peek(step, url)
            if url == self.memory_url and self._another_runs(step, base, candidates):
                continue
            error: BaseException | None = None
            code = _OK
            try:
                target = self._state(trainer, target=True, memory=url == self.memory_url)
                stateless = _leave_out_stateless(target["optim"]["state"], saved)
                result = storage.load(
                    target,
                    url,
                    step,
                    process_group=self.process_group,
                    storage_options=self.storage_options if url == self.url else None,
                    options=self.load_options,
                )
            except (storage.StateMismatchError, storage.NewerFormatError) as e:
                error, code = e, _FATAL
            except (storage.CheckpointError, OSError) as e:
                error, code = e, _FALLBACK
            except Exception as e:  # still reach the agreement, or the other ranks would hang
                error, code = e, _FATAL
            if url == self.memory_url:  # a cache (another run's, an older format): never fatal
                code = min(code, _FALLBACK)
            agreed = self._agree(code)
            if agreed == _OK:
                break
            why = f"{type(error).__name__}: {error}" if error else "failed on another rank"
            if agreed == _FATAL:
                if error is not None:
                    raise error
                raise storage.StateMismatchError(
                    f"loading step {step} from {url} failed on another rank (state mismatch)"
                )
            if url == self.url:
                skipped.append((step, why))
            older = candidates[i + 1 : i + 2]
            self._log(
                f"ftsdp: CHECKPOINT STEP {step} AT {url} IS UNUSABLE on rank {rank}: {why}; "
                + (
                    f"falling back to step {older[0][0]} at {older[0][1]}"
                    if older
                    else "no older committed step"
                )
            )
        else:
            if all(c[1] == self.memory_url for c in candidates):
                # nothing durable, and the memory tier's steps are not this run's: a fresh start
                self._log(
                    f"ftsdp: no committed step under {self.url} and none usable in the memory "
                    f"tier {self.memory_url}: starting from scratch"
                )
                for p in list(self.optimizer.state):  # undo init_optimizer_state
                    if id(p) not in had_state:
                        del self.optimizer.state[p]
                self.prepare(trainer)
                return None
            raise storage.CheckpointError(
                f"no usable checkpoint under {self.url}"
                + (f" or {self.memory_url}" if self.memory_url else "")
                + f": committed steps {sorted({c[0] for c in candidates})} all failed"
            )
        self.resumed_from = url
        trainer.update(target["trainer"])
        self.engine.load(target["model"], target["optim"])
        params = self.engine.params_by_name()
        for name in stateless:  # no state when saved: none now either
            self.optimizer.state.pop(params[name], None)
        cs.restore_param_groups(
            self.optimizer,
            target["optim"]["param_groups"],
            self.engine.optim_state()["param_groups"],
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(json.loads(target["scheduler"]))
        same_world = result.saved_world_size == world
        if same_world:
            cs.set_rng_state(target["rng"])
        else:
            cs.reseed(self.seed, step, rank)
        durable = [c[0] for c in candidates if c[1] == self.url and c[0] <= step]
        self.last_saved_step = step if url == self.url else (max(durable) if durable else None)
        self._durable_base = self.last_saved_step
        self._last_save = time.monotonic()
        self._discard_newer = bool(skipped)  # newer than ``step``: an abandoned timeline
        self.prepare(trainer)
        return ResumeInfo(
            step=step,
            saved_world_size=result.saved_world_size,
            seconds=time.perf_counter() - start,
            skipped=skipped,
            rng_restored=same_world,
        )

    def close(self) -> None:
        """Wait for the in-flight save and raise its error (idempotent); takes the fence off
        the optimizer and clears the memory tier (collective when there is one: every rank
        has finished its saves before rank 0 deletes them). Not called when a job fails, so
        that its restart finds the memory tier."""
        try:
            self.wait()
        finally:
            if self._fence is not None:
                self._fence.remove()
                self._fence = None
        self._remove_retired()
        if self.memory_url is not None and self._memory_on:
            rank, world = self._rank_world()
            if world > 1:
                dist.barrier(group=self.process_group)
            try:
                if self._memory_node is not None:  # one rank per node clears its own
                    storage.clear_on_nodes(
                        self.memory_url, node=self._memory_node, process_group=self.process_group
                    )
                elif rank == 0:
                    storage.clear_steps(self.memory_url)
            except OSError as e:
                self._log(f"ftsdp: clearing the memory tier {self.memory_url} failed: {e}")
            self._memory_on = False

    def _remove_retired(self) -> None:
        """Rank 0, once the last save committed: a retention pass that removes the objects the
        last retention left for a next save (``SaveOptions.reuse_retired``), when this manager
        saved (with the retention every save of it applied already, so it removes nothing
        else of the run's own steps)."""
        if (
            self.save_options is not None
            and self.save_options.reuse_retired
            and self.keep_last is not None
            and self._saved_here  # a resume alone never deletes anything
            and not self._discard_newer
            and self._rank_world()[0] == 0
        ):
            try:
                storage.apply_retention(
                    self.url,
                    keep_last=self.keep_last,
                    keep_every=self.keep_every,
                    storage_options=self.storage_options,
                )
            except OSError as e:
                self._log(f"ftsdp: removing retired objects under {self.url} failed: {e}")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _place(url: str) -> str:
    """Where a root is, for telling two roots apart: a local path (plain or ``file://``)
    resolved, any other URL as written without a trailing slash."""
    path = url[len("file://") :] if url.startswith("file://") else url
    if "://" in path:
        return url.rstrip("/")
    return os.path.realpath(path)


def _leave_out_stateless(state: dict[str, dict[str, Any]], saved: set[str] | None) -> list[str]:
    """Remove from the template ``state`` (``{param: {key: leaf}}``) the parameters that have no
    optimizer state in the checkpoint (``saved``: its ``optim.state.*`` names; None: unknown,
    keep all); returns their names. A parameter with some of its keys saved stays, so that a
    missing key is a mismatch. (A parameter's name is never another's name plus a dot: one is
    a module attribute, the other would need that attribute to be a module.)"""
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
