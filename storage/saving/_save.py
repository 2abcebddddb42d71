"""``save``: plan, stage and write this rank's objects, then commit (``_commit.py``); the async
handle. The phases and threads: docs/design.md, "The commit protocol"."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._layout import check_step, step_dir
from ftsdp.storage.format._objects import PlannedObject
from ftsdp.storage.format._safetensors import write_object
from ftsdp.storage.format._state import TensorLeaf, flatten_state
from ftsdp.storage.format._steps import Known
from ftsdp.storage.io._buffers import ByteBudget
from ftsdp.storage.io._collectives import own_group, rank_world, release_own_group, resolve_group
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._streaming import piece_bytes
from ftsdp.storage.saving._commit import Lineage, finish, fresh_attempt, plan_lineage
from ftsdp.storage.saving._exchange import exchange
from ftsdp.storage.saving._nodes import finish_on_nodes
from ftsdp.storage.saving._save_plan import SavePlan
from ftsdp.storage.saving._shares import describe
from ftsdp.storage.saving._staging import (
    SnapshotArena,
    aligned_bytes,
    copy_cpu,
    copy_into,
    stage,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)
_lock = threading.Lock()


class _Lane:
    """The saves of this process to one root (``Store.where()``), one after the other: the
    latest handle, the snapshot arena, the writer threads (and storage's own group), and what
    the saves learned of the root (``Known``: the next save lists and reads less)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.known = Known()
        self.previous: SaveHandle | None = None
        self.arena = SnapshotArena()
        self._writers: tuple[int, ThreadPoolExecutor] | None = None
        self._workers: dict[str, Worker] = {}

    def worker(self, role: str) -> Worker:
        """The lane's thread for ``role`` (``copy``: the snapshots; ``run``: the plan, the
        writes' hand-off and the commit), started on first use and kept for the next saves: a
        thread started per save kept the caller waiting for it to start."""
        with _lock:
            worker = self._workers.get(role)
            if worker is None:
                name = "storage-snapshot" if role == "copy" else "storage-save-run"
                worker = self._workers[role] = Worker(name)
            return worker

    def close(self) -> None:
        """Let go of the lane's threads and snapshot memory (its saves are done)."""
        with _lock:
            writers, self._writers = self._writers, None
            workers, self._workers = list(self._workers.values()), {}
        if writers is not None:
            writers[1].shutdown(wait=True)
        for worker in workers:
            worker.stop()
        self.arena.clear()

    def writers(self, threads: int) -> ThreadPoolExecutor:
        """The lane's pool of ``threads`` writer threads (made again when a save asks for
        another number; the saves of a lane never overlap, so the old one is idle)."""
        with _lock:
            if self._writers is None or self._writers[0] != threads:
                if self._writers is not None:
                    self._writers[1].shutdown(wait=False)
                self._writers = threads, ThreadPoolExecutor(threads, "storage-save")
            return self._writers[1]


class Worker:
    """A daemon thread running the jobs handed to it one after the other (a job catches its own
    errors: one that escapes is logged and the thread goes on), ended after ``_IDLE_S`` without
    a job and started again by the next. Daemon: a save waiting on a dead peer never holds the
    exit up."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._fresh()

    def _fresh(self) -> None:
        self._pid = os.getpid()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._guard = threading.Lock()
        self._running = False

    def stop(self) -> None:
        """End the thread once the jobs handed over before are done (a later job starts
        another)."""
        with self._guard:
            if self._running and self._pid == os.getpid():
                self._jobs.put(None)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after the jobs handed over before it (returns at once)."""
        if self._pid != os.getpid():  # a forked child: the parent's thread is not here
            self._fresh()
        with self._guard:
            self._jobs.put(job)
            if not self._running:
                self._running = True
                threading.Thread(target=self._serve, name=self.name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_S)
            except queue.Empty:
                job = None
            if job is None:  # idle, or stopped
                with self._guard:  # a job put meanwhile is served by this thread still
                    if self._jobs.empty():
                        self._running = False
                        return
                continue
            try:
                job()
            except BaseException:
                logger.exception("ftsdp: a background job (%s) failed", self.name)
            job = None  # what it holds is not kept while the thread waits for the next


_IDLE_S = 120.0  # a lane's thread ends after this long without a save (a process of many roots)
_lanes: dict[str, _Lane] = {}


def _lane(key: str) -> _Lane:
    with _lock:
        lane = _lanes.get(key)
        if lane is None:
            lane = _lanes[key] = _Lane(key)
        return lane


def release(url: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """Let go of what this process keeps for its saves to ``url`` once they are done: the
    snapshot memory (the size of the rank's share), the writer and background threads, storage's
    own process group for that root and what the saves learned of it. A process that saves to
    many roots (a sweep, a notebook) keeps all that for each root until then. Collective: every
    rank calls it, after its last save to ``url``; the save in flight is waited for (its error
    stays its handle's). A later save to ``url`` makes them again. ``CheckpointManager.close()``
    does it for its roots."""
    key = Store(url, storage_options).where()
    with _lock:
        lane = _lanes.pop(key, None)
    if lane is not None:
        if lane.previous is not None:
            with contextlib.suppress(Exception):
                lane.previous.wait()
        lane.close()
    release_own_group(key)  # (a restore on nodes makes one with no lane)


def _forget_in_child() -> None:
    """After ``os.fork()``: the parent's saves and threads are not the child's."""
    global _lock, _lanes
    _lock = threading.Lock()
    _lanes = {}


def _warn_in_flight_at_exit() -> None:
    """At exit, warn of each save still in flight (its daemon threads die uncommitted). A copy
    still running is waited for first: a daemon thread leaving a torch op during finalization
    aborts the process."""
    with _lock:
        pending = [lane.previous for lane in _lanes.values() if lane.previous is not None]
    deadline = time.monotonic() + _EXIT_COPY_WAIT_S
    for handle in pending:
        handle._snapshot.wait(max(0.0, deadline - time.monotonic()))
    for handle in pending:
        if not handle.done():
            logger.warning(
                "storage: the save of step %d to %s was still in flight at exit and is not "
                "committed; wait for it before exiting (handle.wait(), or the "
                "CheckpointManager's close())",
                handle.step,
                handle.url,
            )


_EXIT_COPY_WAIT_S = 30.0
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
    (at once when there is none): the fence before changing saved tensors in place after a
    ``save(..., defer_copy=True)``."""
    with _lock:
        latest = [lane.previous for lane in _lanes.values() if lane.previous is not None]
    for prev in latest:
        prev.wait_snapshot(timeout)


def snapshot_fence(optimizer: torch.optim.Optimizer) -> Any:
    """Make ``optimizer.step()`` wait for the latest deferred save's snapshot (a step pre-hook
    calling :func:`wait_snapshot`); returns the hook's handle (``.remove()`` takes it away).
    Other in-place changes of saved tensors need an explicit :func:`wait_snapshot` first."""
    return optimizer.register_step_pre_hook(lambda *_: wait_snapshot())


def _wait_previous(lane: _Lane) -> None:
    """Wait for the lane's previous save; raise its error if nobody has seen it."""
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
    ``FlatShard``s or JSON-able values. Returns when committed; with ``async_save=True`` once
    this rank's tensors are copied to host memory (``handle.wait()`` raises the background's
    error); with ``defer_copy=True`` too before the copy: saved tensors change in place only
    after ``handle.wait_snapshot()`` (:func:`wait_snapshot`, :func:`snapshot_fence`).

    Raises FileExistsError for a committed ``step``, CheckpointError behind newer committed
    steps (unless ``SaveOptions(discard_newer=True)``), ``CommitConflictError`` for a
    concurrent or stale writer (docs/design.md, "One timeline").
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

    ``node``: this rank's node id; the ranks with one id share ``url``, each node has its own
    directory there ([Note: node-local roots]; :func:`restore_on_nodes` before loading).
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
    check_step(step)
    if defer_copy and not async_save:
        raise ValueError("defer_copy=True needs async_save=True (a sync save copies as it writes)")
    store = Store(url, storage_options, options.io)
    lane = _lane(store.where())
    _wait_previous(lane)
    group = resolve_group(process_group)
    own = own_group(group, lane.key) if node is not None or async_save else None
    if node is not None and group is not None and own is None:
        raise ValueError(
            f"save_on_nodes(node={node!r}) to {url}: node-local roots need every rank of the "
            "job (a gloo group of storage's own); the process group given is a subgroup"
        )
    save = _Save(store, step, group, options, lane, node, own)
    handle = SaveHandle(step, store.where())
    with _lock:
        lane.previous = handle
    # Every rank reaches the exchange even when its own state is bad, so errors never hang.
    try:
        save.tensors, values = describe(state)
        save.meta["values"] = values
    except Exception as e:
        save.failed(e)
    size = _snapshot_size(store, save.tensors, options, defer_copy) if async_save else None
    snapshot = None if size is None else _Snapshot(save, handle, start, size[0])
    job: _SaveJob | None = None
    if not async_save or (group is not None and own is None):  # sync, or over a subgroup
        try:
            job = save.plan(group)
            if not async_save:
                job.write_and_commit(job.submit_live())
        except BaseException as e:
            if snapshot is not None:  # the lane's arena is the next save's: leave it settled
                snapshot.settle()
            handle._observed = True  # raised here, not again by the next save
            handle._finish(e)
            raise
    if not async_save:
        handle._finish(None)
    else:
        _in_background(handle, save, job, snapshot, start)  # peers learn of errors there
        if save.error is not None:
            handle._observed = True  # raised here, not again by the next save
            raise save.error
        if not defer_copy:
            handle._snapshot.wait()  # the copy is done (or the save failed: wait() says)
    handle.blocking_seconds = time.perf_counter() - start
    return handle


class _Save:
    """What one ``save`` call knows before its plan."""

    def __init__(
        self,
        store: Store,
        step: int,
        group: ProcessGroup | None,
        options: SaveOptions,
        lane: _Lane,
        node: str | None,
        own: ProcessGroup | None,
    ) -> None:
        self.store, self.step, self.options, self.lane = store, step, options, lane
        self.rank, _ = rank_world(group)
        self.node, self.own = node, own  # own: storage's group over every rank (or None)
        self.tensors: dict[str, TensorLeaf] = {}
        self.meta: dict[str, Any] = {"error": None}
        self.error: Exception | None = None  # this rank's own, reported in the exchange

    def failed(self, error: Exception) -> None:
        self.error, self.meta["error"] = error, f"{type(error).__name__}: {error}"

    def plan(self, group: ProcessGroup | None) -> _SaveJob:
        """Rank 0 reads the root and decides for every rank; then the exchange over ``group``
        (collective; raises on every rank when any rank failed)."""
        lineage: Lineage | None = None
        if self.rank == 0 and self.error is None:
            try:
                discard = self.options.discard_newer
                lineage = plan_lineage(self.store, self.step, discard, self.lane.known)
                self.meta["attempt"], self.meta["replaces"] = fresh_attempt(), lineage.replaces
            except Exception as e:
                self.failed(e)
        try:
            plan, values, world = exchange(self.tensors, self.meta, group, self.step, self.options)
        except CheckpointError:
            if self.error is not None:  # this rank's own error, as it was raised
                raise self.error from None
            raise
        return _SaveJob(self, plan, values, world, lineage)


def _snapshot_size(
    store: Store, tensors: dict[str, TensorLeaf], options: SaveOptions, deferred: bool
) -> tuple[int, bool] | None:
    """``(bytes, on CUDA)`` of the snapshot of ``tensors``; None where a save takes none: a
    deferred save written from the live tensors, or a share over the staging budget."""
    local = [t.local for t in tensors.values()]
    # no tensor is on CUDA before CUDA is initialised (a save of CPU tensors asks nothing more)
    cuda = torch.cuda.is_initialized() and any(t.device.type == "cuda" for t in local)
    if deferred and in_place(store, cuda):
        return None
    total = sum(aligned_bytes(t.numel() * t.element_size()) for t in local)
    return None if total > options.staging_budget_bytes else (total, cuda)


class _Snapshot:
    """This rank's tensors copied into the lane's arena on a thread of its own."""

    def __init__(self, save: _Save, handle: SaveHandle, start: float, total: int) -> None:
        self.handle, self.t0 = handle, start  # its event is set once the copy is done
        self.total = total  # bytes of the arena it takes
        self.leaves = list(save.tensors.values())
        self.flat = [leaf.local.reshape(-1) for leaf in self.leaves]  # views, mostly
        self.ready = queued_work_event(self.flat)  # CUDA: copy after the work queued so far
        self.arena = save.lane.arena
        # on the CPU, the tensors it copies into, made here on the caller's thread (see leaves)
        self.into = self.arena.leaves(self.flat) if self.ready is None else None
        self.bytes: dict[str, memoryview] = {}
        self.error: BaseException | None = None
        self._copied = threading.Event()  # the copy is over, whatever its outcome
        save.lane.worker("copy").submit(self._copy)

    def _copy(self) -> None:
        try:
            if self.into is not None:
                copy_cpu(self.into[0], self.flat)
                raw = self.into[1]
            else:
                stream = side_stream(self.ready)
                buf = self.arena.pinned(self.total)
                raw = copy_into(self.flat, buf, stream, self.arena.layouts, as_bytes=True)
            self.bytes = {leaf.name: b for leaf, b in zip(self.leaves, raw, strict=True)}
        except BaseException as e:
            self.error = e
        self._copied.set()
        self.handle._snapshot_done(self.t0)  # a failure too: the save fails, at wait()

    def join(self) -> None:
        """Wait for the copy; raise its error."""
        self.settle()
        if self.error is not None:
            raise self.error

    def settle(self) -> None:
        """Wait for the copy, whatever its outcome."""
        self._copied.wait()


def _in_background(
    handle: SaveHandle,
    save: _Save,
    job: _SaveJob | None,
    snapshot: _Snapshot | None,
    start: float,
) -> None:
    """The rest of an async save on the lane's daemon thread: plan (on storage's own group),
    stage (without a snapshot: then the fence opens here), write, commit."""

    def run() -> None:
        try:
            planned = job or save.plan(save.own)
            uploads = planned.submit_staged(snapshot, handle)
            if snapshot is None:
                handle._snapshot_done(start)
            planned.write_and_commit(uploads)
            if not save.options.reuse_staging:
                save.lane.arena.clear()
        except BaseException as e:
            handle._finish(e)
        else:
            handle._finish(None)

    save.lane.worker("run").submit(run)


class _SaveJob:
    """A planned save on one rank: its objects to write, then the commit."""

    def __init__(
        self,
        save: _Save,
        plan: SavePlan,
        values: dict[str, Any],
        world_size: int,
        lineage: Lineage | None,
    ) -> None:
        self.save, self.plan, self.values, self.world_size = save, plan, values, world_size
        self.lineage = lineage  # rank 0's view of the root when it planned
        self.mine = plan.own(save.rank)
        self.options = save.options

    def _pieces(
        self, obj: PlannedObject, snapshot: _Snapshot | None = None, in_place: bool = False
    ) -> list[Any]:
        """``obj``'s pieces: bytes of the ``snapshot`` when given, else of the live tensors
        read in place (``in_place``: ``piece_bytes``), else 1-D views of the live tensors."""
        out: list[Any] = []
        for p in obj.pieces:
            leaf = self.save.tensors[p.name]
            start = p.offset - leaf.range.offset
            if snapshot is not None:
                size = p.dtype.itemsize
                out.append(snapshot.bytes[p.name][start * size : (start + p.length) * size])
            elif in_place:
                out.append(piece_bytes(leaf.local, start, p.length))
            elif start == 0 and leaf.local.dim() == 1 and p.length == leaf.local.numel():
                out.append(leaf.local)  # the whole leaf (most pieces): no view to make
            else:
                out.append(leaf.local.reshape(-1)[start : start + p.length])
        return out

    def _write(self, obj: PlannedObject, payloads: list[Any]) -> list[list[int]]:
        result: list[list[int]] = []

        def produce(f: Any) -> None:
            result[:] = write_object(
                f, obj.head, len(payloads), enumerate(payloads), self.options.checksum_block_bytes
            )

        self.save.store.write(f"{step_dir(self.save.step)}/{obj.name}", produce)
        return result

    def _writers(self) -> ThreadPoolExecutor:
        return self.save.lane.writers(self.options.io.threads)

    def submit_live(self) -> tuple[list[Future], BaseException | None]:
        """Hand each object, read from the live tensors, to the writer threads (a sync save)."""
        futures: list[Future] = []
        try:
            for obj in self.mine:
                futures.append(self._writers().submit(self._write, obj, self._pieces(obj)))
        except BaseException as e:  # still take part in the commit protocol, as a failure
            return futures, e
        return futures, None

    def submit_staged(
        self, snapshot: _Snapshot | None, handle: SaveHandle
    ) -> tuple[list[Future], BaseException | None]:
        """Hand each object to the writer threads once this rank's share is safe from changes:
        from the ``snapshot``; without one, written from the live tensors on a tmpfs root (the
        writes done before this returns), or staged object by object within the budget.
        Returns the uploads and the first error (the commit protocol still runs, as a
        failure)."""
        pool, futures = self._writers(), []
        try:
            if snapshot is not None:
                snapshot.join()
                handle.staging_peak_bytes = sum(len(b) for b in snapshot.bytes.values())
                for obj in self.mine:
                    futures.append(pool.submit(self._write, obj, self._pieces(obj, snapshot)))
                return futures, None
            cuda = any(t.local.device.type == "cuda" for t in self.save.tensors.values())
            if in_place(self.save.store, cuda):
                live = [self._pieces(obj, in_place=True) for obj in self.mine]  # before any write
                futures = [
                    pool.submit(self._write, o, b) for o, b in zip(self.mine, live, strict=True)
                ]
                wait(futures)  # the snapshot: the bytes are in the files now
                return futures, None
            budget = ByteBudget(self.options.staging_budget_bytes)

            def upload(obj: PlannedObject, staged: list[torch.Tensor]) -> Any:
                try:
                    return self._write(obj, staged)
                finally:
                    budget.release(obj.payload_bytes)

            try:
                for obj in self.mine:
                    budget.acquire(obj.payload_bytes)
                    futures.append(pool.submit(upload, obj, stage(self._pieces(obj))))
            finally:
                handle.staging_peak_bytes = budget.peak
            return futures, None
        except BaseException as e:
            return futures, e

    def write_and_commit(self, uploads: tuple[list[Future], BaseException | None]) -> None:
        """Wait for this rank's writes, then the commit (storage/saving/_commit.py)."""
        futures, error = uploads
        crcs: dict[str, list[list[int]]] = {}
        for obj, fut in zip(self.mine, futures, strict=False):
            try:
                crcs[obj.name] = fut.result()
            except BaseException as e:
                error = error or e
        save = self.save
        common: dict[str, Any] = {
            "values": self.values,
            "world_size": self.world_size,
            "checksum_block_bytes": self.options.checksum_block_bytes,
            "keep_last": self.options.keep_last,
            "keep_every": self.options.keep_every,
            "lineage": self.lineage,
        }
        args = (save.store, save.step, self.plan, save.rank, crcs, error)
        if save.node is not None:
            finish_on_nodes(
                *args,
                node=save.node,
                group=save.own,
                discard_newer=self.options.discard_newer,
                **common,
            )
            return
        timeout = self.options.commit_timeout_s
        finish(
            *args, timeout_s=timeout, replaces=self.plan.replaces, known=save.lane.known, **common
        )


def prepare_save(
    state: Mapping[str, Any] | None,
    url: str,
    *,
    process_group: ProcessGroup | None = None,
    storage_options: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
) -> int:
    """Get ready for ``save(..., async_save=True)`` to ``url``; collective over
    ``process_group`` the first time. Returns the bytes of host memory reserved.

    Creates storage's own process group for saves to ``url`` and, given the ``state``, reserves
    its snapshot memory when it fits in ``options.staging_budget_bytes`` (else the first save).
    """
    options = options or SaveOptions()
    store = Store(url, storage_options, options.io)
    lane = _lane(store.where())
    own_group(resolve_group(process_group), lane.key)
    if state is None:
        return 0
    tensors = flatten_state(state)[0]
    size = _snapshot_size(store, tensors, options, deferred=True)
    if size is None:
        return 0
    lane.arena.reserve([t.local.reshape(-1) for t in tensors.values()], *size)
    return size[0]


def in_place(store: Store, cuda: bool) -> bool:
    """Whether a deferred save writes its objects straight from the live tensors (the root on
    tmpfs, no tensor on CUDA) instead of copying them into the snapshot arena first."""
    return not cuda and store.tmpfs


def queued_work_event(tensors: list[torch.Tensor]) -> Any:
    """(event, device) after the work queued so far on the caller's stream, when a saved tensor
    is on CUDA (the copy must wait for the values); else None."""
    if any(t.device.type == "cuda" for t in tensors):
        event = torch.cuda.Event()
        event.record()
        return event, torch.cuda.current_device()
    return None


def side_stream(ready: Any) -> Any:
    """A CUDA stream for the snapshot copies after ``ready``'s event; None without CUDA."""
    if ready is None:
        return None
    event, device = ready
    torch.cuda.set_device(device)  # this thread's pinned memory and copies: the caller's device
    stream = torch.cuda.Stream(device=device)
    stream.wait_event(event)
    return stream
