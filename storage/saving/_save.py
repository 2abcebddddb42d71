"""``save``: plan collectively, write this rank's objects, commit (see docs/format.md).

This module plans, stages and writes this rank's objects and owns the async handle; the commit
itself (done and abort markers, the manifest, ``latest``, retention) is ``storage/saving/_commit.py``'s
(see [Note: commit without collectives in the background] there).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._layout import step_dir
from ftsdp.storage.format._objects import PlannedObject
from ftsdp.storage.format._safetensors import write_object
from ftsdp.storage.format._state import TensorLeaf, flatten_state
from ftsdp.storage.io._collectives import own_group, rank_world, resolve_group
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._streaming import piece_bytes
from ftsdp.storage.saving._commit import Lineage, finish, fresh_attempt, plan_lineage
from ftsdp.storage.saving._exchange import exchange
from ftsdp.storage.saving._nodes import finish_on_nodes
from ftsdp.storage.saving._save_plan import SavePlan
from ftsdp.storage.saving._staging import (
    SnapshotArena,
    StagingBudget,
    StagingPool,
    aligned_bytes,
    copy_into,
    stage,
    staged_bytes,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_staging_pool = StagingPool()  # async saves of this process (thread-safe)


class _Lane:
    """The saves of this process to one root, one after the other (see [Note: one lane per
    root]): the latest save's handle, the snapshot memory and the threads writing objects."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.previous: SaveHandle | None = None
        self.arena = SnapshotArena()
        self._writers: tuple[int, ThreadPoolExecutor] | None = None

    def writers(self, threads: int) -> ThreadPoolExecutor:
        """The lane's pool of ``threads`` writer threads (made again when a save asks for
        another number; the saves of a lane never overlap, so the old one is idle)."""
        with _lock:
            if self._writers is None or self._writers[0] != threads:
                if self._writers is not None:
                    self._writers[1].shutdown(wait=False)
                self._writers = threads, ThreadPoolExecutor(threads, "storage-save")
            return self._writers[1]


# [Note: one lane per root]
# Saves to one root follow each other (errors surface in order; a step never races its
# predecessor's retention); saves to different roots are independent, so each root
# (``Store.where()``) has its own lane: latest handle, snapshot arena, writer threads and process
# group for deferred saves (docs/elastic.md, the memory tier).
_lanes: dict[str, _Lane] = {}


def _lane(key: str) -> _Lane:
    with _lock:
        lane = _lanes.get(key)
        if lane is None:
            lane = _lanes[key] = _Lane(key)
        return lane


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: no lanes and fresh locks (the parent's saves and their
    threads are not the child's; waiting on them would never end)."""
    global _lock, _lanes, _staging_pool
    _lock = threading.Lock()
    _lanes = {}
    _staging_pool = StagingPool()


def _warn_in_flight_at_exit() -> None:
    """At interpreter exit: a save still in flight dies with the process (the threads that
    exchange and commit are daemons, so that a save waiting on a dead peer never holds a
    failing job up) and is not committed; say so, rather than exit as if it were saved."""
    with _lock:
        pending = [lane.previous for lane in _lanes.values() if lane.previous is not None]
    for handle in pending:
        if not handle.done():
            logger.warning(
                "storage: the save of step %d to %s was still in flight at exit and is not "
                "committed; wait for it before exiting (handle.wait(), or the "
                "CheckpointManager's close())",
                handle.step,
                handle.url,
            )


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_warn_in_flight_at_exit)


class SaveHandle:
    """A save in progress or finished: ``wait()`` blocks and raises its error, ``done()`` polls;
    ``wait_snapshot()`` blocks until the saved tensors may be modified again."""

    def __init__(self, step: int, url: str) -> None:
        self.step = step
        self.url = url
        self.blocking_seconds = 0.0  # time the caller spent inside save()
        self.snapshot_seconds = 0.0  # time from save() to the copy of this rank's share done
        self.fence_wait_seconds = 0.0  # time wait_snapshot() blocked, in total
        self.staging_peak_bytes = 0
        self._done = threading.Event()
        self._snapshot = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    def snapshot_taken(self) -> bool:
        """True once this rank's share of the state has been copied (or the save failed)."""
        return self._snapshot.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until this rank's share of the saved state has been copied: from then on the
        tensors passed to ``save`` may be modified. Does not raise the save's own error (see
        :meth:`wait`); raises TimeoutError after ``timeout`` seconds."""
        if self._snapshot.is_set():
            return
        t0 = time.perf_counter()
        if not self._snapshot.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not taken after {timeout}s")
        self.fence_wait_seconds += time.perf_counter() - t0

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until committed; re-raise the save's error, if any."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} to {self.url} not done after {timeout}s")
        self._observed = True
        if self._error is not None:
            raise self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._snapshot.set()
        self._done.set()

    def _snapshot_done(self, start: float) -> None:
        self.snapshot_seconds = time.perf_counter() - start
        self._snapshot.set()


def wait_snapshot(timeout: float | None = None) -> None:
    """Block until the latest save of this process has copied this rank's share of its state
    (at once when there is none): the fence a training loop puts before the first in-place
    change of saved tensors after a ``save(..., defer_copy=True)``. See
    :func:`snapshot_fence` for an optimizer hook that calls it."""
    with _lock:
        latest = [lane.previous for lane in _lanes.values() if lane.previous is not None]
    for prev in latest:
        prev.wait_snapshot(timeout)


def snapshot_fence(optimizer: torch.optim.Optimizer) -> Any:
    """Make ``optimizer.step()`` wait for the latest deferred save's snapshot before it changes
    anything; returns the hook's handle (``.remove()`` takes the fence away).

    A step pre-hook that calls :func:`wait_snapshot`: free when no snapshot is being copied.
    Install it on every optimizer whose state or parameters are saved with ``defer_copy``; any
    other in-place change of saved tensors needs an explicit :func:`wait_snapshot` first.
    """
    return optimizer.register_step_pre_hook(lambda *_: wait_snapshot())


def _wait_previous(lane: _Lane) -> None:
    """A new save waits for the previous one to the same root; an error nobody has seen is
    raised here."""
    with _lock:
        prev = lane.previous
    if prev is None:
        return
    prev._done.wait()
    if prev._error is not None and not prev._observed:
        prev._observed = True
        raise CheckpointError(
            f"the previous async save (step {prev.step} to {prev.url}) failed: {prev._error}"
        ) from prev._error


def save(
    state: Mapping[str, Any],
    url: str,
    step: int,
    *,
    process_group: ProcessGroup | None = None,
    async_save: bool = False,
    storage_options: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    defer_copy: bool = False,
) -> SaveHandle:
    """Save ``state`` as step ``step`` under ``url``; collective over ``process_group``.

    Leaves of ``state`` are tensors (whole, identical on every rank that holds them), DTensors,
    ``FlatShard``s or JSON-able values. Returns when committed, or with ``async_save=True`` as
    soon as this rank's pieces are staged in host memory (``handle.wait()`` for the commit; a
    save still in flight when the interpreter exits is lost, with a warning).
    ``options`` (``SaveOptions``) also hold retention (``keep_last``, ``keep_every``: applied by
    rank 0 after the commit, never to the step just saved) and ``discard_newer``.

    ``defer_copy=True`` (with ``async_save``) returns as soon as the state is recorded: which
    tensors, their shapes and the JSON values (copied now). The tensors' bytes are copied by a
    background thread, after a metadata exchange on a process group of storage's own; the
    caller must not change a saved tensor in place until ``handle.wait_snapshot()`` (or
    :func:`wait_snapshot`) returns — :func:`snapshot_fence` puts that wait in front of an
    optimizer's ``step()``. See [Note: deferred snapshots]. :func:`prepare_save` ahead of the
    first such save creates that group and the host staging memory.

    Before anything is written, on every rank: a committed ``step`` is never overwritten
    (FileExistsError) and a save behind newer committed steps is refused (CheckpointError),
    unless ``SaveOptions(discard_newer=True)`` (they are deleted once this step is committed). A
    concurrent or stale writer loses with ``CommitConflictError`` (docs/design.md, "One
    timeline"). :func:`save_on_nodes` saves to node-local roots.
    """
    return _save(state, url, step, process_group, async_save, storage_options, options, defer_copy)


def save_on_nodes(
    state: Mapping[str, Any],
    url: str,
    step: int,
    *,
    node: str,
    process_group: Any = None,
    async_save: bool = False,
    storage_options: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    defer_copy: bool = False,
) -> SaveHandle:
    """:func:`save` to a node-local root; collective over every rank of the job.

    ``node`` (this rank's node id; every rank passes one) makes ``url`` a node-local root: the
    ranks with the same id share it, other nodes see their own directory under the same path
    (host shared memory). The step is committed through collectives and each node also keeps a
    replica of the previous node's objects: see [Note: node-local roots] in
    ``storage/saving/_nodes.py`` (:func:`restore_on_nodes` before loading from such a root).
    """
    if not isinstance(node, str) or not node:
        raise ValueError(f"save_on_nodes(node={node!r}): node must be a non-empty str")
    args = (process_group, async_save, storage_options, options, defer_copy)
    return _save(state, url, step, *args, node=node)


def _save(
    state: Mapping[str, Any],
    url: str,
    step: int,
    process_group: Any,
    async_save: bool,
    storage_options: dict[str, Any] | None,
    options: SaveOptions | None,
    defer_copy: bool,
    node: str | None = None,
) -> SaveHandle:
    """``save`` and ``save_on_nodes`` (``node``: None for a shared root)."""
    start = time.perf_counter()
    options = options or SaveOptions()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")
    if defer_copy and not async_save:
        raise ValueError("defer_copy=True needs async_save=True (a sync save copies as it writes)")
    store = Store(url, storage_options, options.io)
    lane = _lane(store.where())
    _wait_previous(lane)
    group = resolve_group(process_group)
    rank, _ = rank_world(group)
    if node is not None and group is not None and own_group(group, lane.key) is None:
        raise ValueError(
            f"save_on_nodes(node={node!r}) to {url}: node-local roots need every rank of the "
            "job (a gloo group of storage's own); the process group given is a subgroup"
        )
    if defer_copy:
        deferred = _DeferredSave(store, step, rank, group, options, lane)
        deferred.node = node
        handle = deferred.begin(state)
        handle.blocking_seconds = time.perf_counter() - start
        return handle

    # Every rank reaches the gather even when its own state is bad, so errors never hang.
    meta: dict[str, Any] = {"error": None}
    local_error: Exception | None = None
    lineage: Lineage | None = None
    tensors: dict[str, TensorLeaf] = {}
    ahead: threading.Thread | None = None
    try:
        tensors, meta = _describe(state)
        ahead = _reserve_ahead(store, lane, tensors, options) if async_save else None
        if rank == 0:  # decides for every rank, before anything is written
            lineage = plan_lineage(store, step, options.discard_newer)
            meta["attempt"], meta["replaces"] = fresh_attempt(), lineage.replaces
    except Exception as e:
        local_error, meta["error"] = e, f"{type(e).__name__}: {e}"
    try:
        plan, values, world = exchange(tensors, meta, group, step, options)
    except CheckpointError:
        if ahead is not None:  # the lane's arena is the next save's: leave it settled
            ahead.join()
        if local_error is not None:
            raise local_error from None
        raise

    handle = _register(SaveHandle(step, store.where()), lane)
    job = _SaveJob(store, step, rank, plan, values, world, tensors, options)
    job.lineage, job.replaces = lineage, plan.replaces
    if node is not None:
        job.node = node
        job.commit_group = None if group is None else own_group(group, lane.key)
    job.lane = lane
    if async_save:
        if ahead is not None:
            ahead.join()
        job.start(handle, lane.arena if ahead is not None else None)
    else:
        try:
            job.run_inline()
        except BaseException as e:
            handle._observed = True
            handle._finish(e)
            raise
        handle._finish(None)
    handle._snapshot_done(start)
    handle.blocking_seconds = time.perf_counter() - start
    return handle


def prepare_save(
    state: Mapping[str, Any] | None,
    url: str,
    *,
    process_group: ProcessGroup | None = None,
    storage_options: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> int:
    """Get ready for ``save(..., async_save=True, defer_copy=True)`` to ``url``; collective over
    ``process_group`` the first time. Returns the bytes of host memory reserved.

    Creates storage's own process group for the saves to ``url`` (see [Note: one lane per
    root]) and, given the ``state`` to be saved, reserves snapshot memory for this rank's
    tensors when it fits in ``options.staging_budget_bytes`` (none for a tmpfs root and CPU
    tensors: see [Note: a tmpfs root written from the live tensors]). Otherwise the first
    deferred save does both.
    """
    options = options or SaveOptions()
    store = Store(url, storage_options, options.io)
    lane = _lane(store.where())
    own_group(resolve_group(process_group), lane.key)
    if state is None:
        return 0
    tensors, _ = flatten_state(state)
    local = [t.local for t in tensors.values()]
    total = sum(aligned_bytes(t.numel() * t.element_size()) for t in local)
    cuda = any(t.device.type == "cuda" for t in local)
    if total > options.staging_budget_bytes or in_place(store, cuda):
        return 0
    lane.arena.reserve(total, cuda)
    return total


def _reserve_ahead(
    store: Store, lane: _Lane, tensors: dict[str, TensorLeaf], options: SaveOptions
) -> threading.Thread | None:
    """For an async save: map the lane's snapshot memory for this rank's share on a thread of
    its own while the caller plans the save, so that the copy after the plan writes into
    memory whose pages are there already; the thread, or None where the save stages as
    before (a tensor off the CPU, a tmpfs root, the share over the staging budget, or
    ``reuse_staging=False``). See [Note: an async save stages into the lane's arena]."""
    local = [t.local for t in tensors.values()]
    total = sum(aligned_bytes(t.numel() * t.element_size()) for t in local)
    if any(t.device.type != "cpu" for t in local) or in_place(store, cuda=False):
        return None
    if not (0 < total <= options.staging_budget_bytes and options.reuse_staging):
        return None
    thread = threading.Thread(
        target=lane.arena.reserve, args=(total, False), name="storage-reserve", daemon=True
    )
    thread.start()
    return thread


# [Note: an async save stages into the lane's arena]
# An async save copies this rank's share before it returns, and its first one copies into
# fresh memory, whose page faults cost more than the copy. The plan comes first (rank 0 reads
# the root, every rank takes part in the exchange), and most of its time is spent waiting for
# the other ranks: the pages are mapped meanwhile, on another thread, into the lane's snapshot
# arena (the deferred saves' memory, kept from save to save; a lane's saves never overlap).
# A share is at most the bytes of this rank's tensors, so that much is reserved. CPU tensors
# only: CUDA tensors stage into pinned memory as before (pinning on another thread would need
# the caller's device set there), and on tmpfs the staging pool's buffers stay (the arena's
# path there writes the objects from the live tensors before it returns: the call would block
# for the writes).


def _register(handle: SaveHandle, lane: _Lane) -> SaveHandle:
    with _lock:
        lane.previous = handle
    return handle


def _describe(
    state: Mapping[str, Any],
) -> tuple[dict[str, TensorLeaf], dict[str, Any]]:  # (tensor leaves, this rank's metadata)
    tensors, values = flatten_state(state)
    copied = json.loads(json.dumps({n: v.value for n, v in values.items()}))  # may change after
    return tensors, {"error": None, "values": copied}


class _SaveJob:
    def __init__(
        self,
        store: Store,
        step: int,
        rank: int,
        plan: SavePlan,
        values: dict[str, Any],
        world_size: int,
        tensors: dict[str, TensorLeaf],
        options: SaveOptions,
    ) -> None:
        self.store, self.step, self.rank = store, step, rank
        self.plan, self.tensors, self.options = plan, tensors, options
        self.values, self.world_size = values, world_size  # this rank's JSON values
        self.mine = plan.own(rank)
        self.lineage: Lineage | None = None  # rank 0's view of the root when it planned
        self.replaces: str | None = None
        self.node: str | None = None  # a node-local root (storage/saving/_nodes.py)
        self.commit_group: ProcessGroup | None = None  # there: storage's own group, for the commit
        self.lane: _Lane | None = None  # set before it runs

    # -- writing this rank's objects ------------------------------------------------------------

    def _payloads(self, obj: PlannedObject, in_place: bool = False) -> list[Any]:
        """``obj``'s pieces as 1-D views of the live tensors, or with ``in_place`` their bytes
        read in place (``piece_bytes``; this job holds the tensors in ``self.tensors``): see
        [Note: a tmpfs root written from the live tensors]."""
        out: list[Any] = []
        for p in obj.pieces:
            leaf = self.tensors[p.name]
            local, start = leaf.local, p.offset - leaf.range.offset
            if in_place:
                out.append(piece_bytes(local, start, p.length))
            elif start == 0 and local.dim() == 1 and p.length == local.numel():
                out.append(local)  # the whole leaf (most pieces): no view to make
            else:
                out.append(local.reshape(-1)[start : start + p.length])  # 1D
        return out

    def _write(self, obj: PlannedObject, payloads: list[Any]) -> list[list[int]]:
        result: list[list[int]] = []

        def produce(f: Any) -> None:
            result[:] = write_object(
                f, obj.head, len(payloads), enumerate(payloads), self.options.checksum_block_bytes
            )

        self.store.write(f"{step_dir(self.step)}/{obj.name}", produce)
        return result

    def _writers(self) -> ThreadPoolExecutor:
        assert self.lane is not None, "a save job runs in a lane"
        return self.lane.writers(self.options.io.threads)

    def run_inline(self) -> None:
        futures: list[Future] = []
        error: BaseException | None = None
        pool = self._writers()
        try:
            for obj in self.mine:
                futures.append(pool.submit(self._write, obj, self._payloads(obj)))
        except BaseException as e:  # still take part in the commit protocol, as a failure
            error = e
        self._finish_and_commit(futures, error)

    def start(self, handle: SaveHandle, arena: SnapshotArena | None = None) -> None:
        """Stage (blocking: into ``arena`` when given, CPU tensors only, else within the
        budget), upload and commit in the background."""
        futures, error = self.stage_and_submit(self._writers(), handle, arena)

        def background() -> None:
            try:
                self._finish_and_commit(futures, error)
            except BaseException as e:
                handle._finish(e)
            else:
                handle._finish(None)

        threading.Thread(target=background, name=f"storage-save-{self.step}", daemon=True).start()

    def stage_and_submit(
        self,
        pool: ThreadPoolExecutor,
        handle: SaveHandle,
        arena: SnapshotArena | None = None,
        stream: Any = None,
    ) -> tuple[list[Future], BaseException | None]:
        """Copy this rank's pieces to host memory and hand each object to ``pool`` to upload.

        A deferred save (CUDA copies on ``stream``) puts everything into its lane's ``arena``
        when it fits in the staging budget; otherwise objects are staged one by one within the budget, into
        buffers kept for the next save. Returns the uploads and the first error (the commit
        protocol still runs, as a failure)."""
        futures: list[Future] = []
        try:
            if arena is not None and in_place(self.store, cuda=stream is not None):
                # [Note: a tmpfs root written from the live tensors]
                live = [self._payloads(obj, in_place=True) for obj in self.mine]  # before any write
                futures = [
                    pool.submit(self._write, o, b) for o, b in zip(self.mine, live, strict=True)
                ]
                wait(futures)  # the snapshot: the bytes are in the files now
                return futures, None
            payloads = [self._payloads(obj) for obj in self.mine]
            sizes = [staged_bytes(obj) for obj in self.mine]
            if arena is not None and sum(sizes) <= self.options.staging_budget_bytes:
                buf, off = arena.take(sum(sizes), stream is not None), 0  # (a stream: CUDA)
                for obj, tensors, size in zip(self.mine, payloads, sizes, strict=True):
                    staged = copy_into(
                        tensors, buf[off : off + size], stream, arena.layouts, as_bytes=True
                    )
                    futures.append(pool.submit(self._write, obj, staged))
                    off += size
                handle.staging_peak_bytes = sum(sizes)
                return futures, None
            return self._stage_in_budget(pool, handle, payloads, futures)
        except BaseException as e:
            return futures, e

    def _stage_in_budget(
        self,
        pool: ThreadPoolExecutor,
        handle: SaveHandle,
        payloads: list[list[torch.Tensor]],
        futures: list[Future],
    ) -> tuple[list[Future], BaseException | None]:
        budget = StagingBudget(self.options.staging_budget_bytes)
        reuse = self.options.reuse_staging
        if not reuse:
            _staging_pool.clear()

        def upload(obj: PlannedObject, staged: list[torch.Tensor], buf: torch.Tensor) -> Any:
            try:
                return self._write(obj, staged)
            finally:
                budget.release(obj.payload_bytes)
                if reuse:
                    _staging_pool.give(buf, self.options.staging_budget_bytes)

        kinds = set()
        error: BaseException | None = None
        try:
            for obj, tensors in zip(self.mine, payloads, strict=True):
                budget.acquire(obj.payload_bytes)
                staged, buf = stage(tensors, _staging_pool if reuse else None)
                kinds.add((buf.numel(), buf.is_pinned()))
                futures.append(pool.submit(upload, obj, staged, buf))
        except BaseException as e:  # still take part in the commit protocol, as a failure
            error = e
        _staging_pool.clear(keep=kinds)  # buffers of earlier, other states: free them
        handle.staging_peak_bytes = budget.peak
        return futures, error

    # -- the commit (storage/saving/_commit.py) ---------------------------------------------------------

    def _finish_and_commit(self, futures: list[Future], error: BaseException | None) -> None:
        crcs: dict[str, list[list[int]]] = {}
        for obj, fut in zip(self.mine, futures, strict=False):
            try:
                crcs[obj.name] = fut.result()
            except BaseException as e:
                error = error or e
        common: dict[str, Any] = {
            "values": self.values,
            "world_size": self.world_size,
            "checksum_block_bytes": self.options.checksum_block_bytes,
            "keep_last": self.options.keep_last,
            "keep_every": self.options.keep_every,
            "lineage": self.lineage,
        }
        args = (self.store, self.step, self.plan, self.rank, crcs, error)
        if self.node is not None:
            finish_on_nodes(
                *args,
                node=self.node,
                group=self.commit_group,
                discard_newer=self.options.discard_newer,
                **common,
            )
            return
        finish(*args, timeout_s=self.options.commit_timeout_s, replaces=self.replaces, **common)


# [Note: deferred snapshots]
# A deferred save records the tensors and copies the JSON values on the caller's thread; a
# background thread plans (on storage's own group), copies this rank's pieces into the lane's
# arena (CUDA ones on a side stream that first waits for the work queued before save()), sets
# the snapshot event, then writes and commits. Nothing saved may change in place until
# ``wait_snapshot()``; a failure sets the snapshot event too (docs/elastic.md, "Saves that do not
# stop training").


class _DeferredSave:
    """One ``save(..., defer_copy=True)``: records on the caller's thread, works on its own."""

    def __init__(
        self,
        store: Store,
        step: int,
        rank: int,
        group: ProcessGroup | None,
        options: SaveOptions,
        lane: _Lane,
    ) -> None:
        self.store, self.step, self.rank, self.options = store, step, rank, options
        self.lane = lane
        self.own = own_group(group, lane.key)  # None: exchange here, on the caller's group
        self.group = group if self.own is None else self.own
        self.node: str | None = None  # a node-local root (storage/saving/_nodes.py)

    def begin(self, state: Mapping[str, Any]) -> SaveHandle:
        start = time.perf_counter()
        handle = _register(SaveHandle(self.step, self.store.where()), self.lane)
        local_error: Exception | None = None
        tensors: dict[str, TensorLeaf] = {}
        try:
            tensors, meta = _describe(state)
        except Exception as e:  # the peers still learn of it in the exchange: nobody hangs
            local_error, meta = e, {"error": f"{type(e).__name__}: {e}"}
        ready = _queued_work_event(tensors)
        planned: list[_SaveJob] = []  # the job, when planned on this thread
        if self.own is None and self.group is not None:  # a subgroup: exchange on this thread
            try:
                planned.append(self._plan(meta, tensors))
            except BaseException as e:
                handle._observed = True  # raised here, not again by the next save
                handle._finish(e)
                raise local_error or e from None
            if local_error is not None:
                raise local_error

        def run() -> None:
            try:
                job = planned[0] if planned else self._plan(meta, tensors)
                stream = _side_stream(ready)
                futures, error = job.stage_and_submit(
                    job._writers(), handle, self.lane.arena, stream
                )
                handle._snapshot_done(start)
                job._finish_and_commit(futures, error)
            except BaseException as e:
                handle._finish(e)
            else:
                handle._finish(None)

        # A daemon: a save waiting on a dead peer never holds up the exit (a save still in
        # flight then is lost, with a warning: see _warn_in_flight_at_exit).
        threading.Thread(target=run, name=f"storage-snapshot-{self.step}", daemon=True).start()
        if local_error is not None:
            handle._observed = True  # raised here, not again by the next save
            raise local_error
        return handle

    def _plan(self, meta: dict[str, Any], tensors: dict[str, TensorLeaf]) -> _SaveJob:
        lineage: Lineage | None = None
        if self.rank == 0 and meta["error"] is None:  # decides for every rank
            try:
                lineage = plan_lineage(self.store, self.step, self.options.discard_newer)
                meta["attempt"], meta["replaces"] = fresh_attempt(), lineage.replaces
            except Exception as e:
                meta["error"] = f"{type(e).__name__}: {e}"
        plan, values, world = exchange(tensors, meta, self.group, self.step, self.options)
        job = _SaveJob(self.store, self.step, self.rank, plan, values, world, tensors, self.options)
        job.lineage, job.replaces = lineage, plan.replaces
        if self.node is not None:
            job.node, job.commit_group = self.node, self.own
        job.lane = self.lane
        return job


def in_place(store: Store, cuda: bool) -> bool:
    """Whether a deferred save writes its objects straight from the live tensors (the root on
    tmpfs, no tensor on CUDA) instead of copying them into the snapshot arena first: see
    [Note: a tmpfs root written from the live tensors]."""
    return not cuda and store.tmpfs


# [Note: a tmpfs root written from the live tensors]
# A file on tmpfs is host memory: with every saved tensor on the CPU a deferred save writes its
# objects from the live tensors and the snapshot is done when the writes are (no arena, nothing
# reserved by ``prepare_save``); elsewhere the arena stays (docs/elastic.md, "Saves that do not
# stop training").


def _queued_work_event(tensors: dict[str, TensorLeaf]) -> Any:
    """A CUDA event after the work queued so far on the caller's current stream, when a saved
    tensor lives on CUDA (the copy must not start before the values are computed); else None."""
    if any(t.local.device.type == "cuda" for t in tensors.values()):
        event = torch.cuda.Event()
        event.record()
        return event, torch.cuda.current_device()
    return None


def _side_stream(ready: Any) -> Any:
    """A CUDA stream on the caller's device for the snapshot copies, waiting for the event of
    :func:`_queued_work_event`; None without CUDA."""
    if ready is None:
        return None
    event, device = ready
    stream = torch.cuda.Stream(device=device)
    stream.wait_event(event)
    return stream
