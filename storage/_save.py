"""``save``: plan collectively, write this rank's objects, commit (see docs/format.md).

This module plans, stages and writes this rank's objects and owns the async handle; the commit
itself (done and abort markers, the manifest, ``latest``, retention) is ``storage/_commit.py``'s
(see [Note: commit without collectives in the background] there).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ftsdp.storage._collectives import all_gather_json, rank_world, resolve_group
from ftsdp.storage._commit import Lineage, finish, fresh_attempt, plan_lineage
from ftsdp.storage._dtypes import dtype_name
from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import step_dir
from ftsdp.storage._options import SaveOptions
from ftsdp.storage._safetensors import write_object
from ftsdp.storage._save_plan import PlannedObject, SavePlan, make_plan
from ftsdp.storage._staging import StagingBudget, StagingPool, stage
from ftsdp.storage._state import TensorLeaf, flatten_state

_lock = threading.Lock()
_previous: SaveHandle | None = None
_staging_pool = StagingPool()  # async saves of this process, one at a time


class SaveHandle:
    """A save in progress or finished: ``wait()`` blocks and raises its error, ``done()`` polls."""

    def __init__(self, step: int, url: str) -> None:
        self.step = step
        self.url = url
        self.blocking_seconds = 0.0  # time the caller spent inside save()
        self.staging_peak_bytes = 0
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

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
        self._done.set()


def _wait_previous() -> None:
    """A new save waits for the previous one; an error nobody has seen is raised here."""
    with _lock:
        prev = _previous
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
    process_group: Any = None,
    async_save: bool = False,
    storage_options: dict[str, Any] | None = None,
    keep_last: int | None = None,
    keep_every: int | None = None,
    options: SaveOptions | None = None,
    discard_newer: bool = False,
) -> SaveHandle:
    """Save ``state`` as step ``step`` under ``url``; collective over ``process_group``.

    Leaves of ``state`` are tensors (whole, identical on every rank that holds them), DTensors,
    ``FlatShard``s or JSON-able values. Returns when committed, or with ``async_save=True`` as
    soon as this rank's pieces are staged in host memory (``handle.wait()`` for the commit).
    With ``keep_last`` rank 0 applies retention after the commit (see ``apply_retention``); it
    never removes the step just saved.

    A committed ``step`` is never overwritten (FileExistsError), and a save behind newer
    committed steps is refused (CheckpointError naming them), both on every rank before anything
    is written: after a save, the newest committed step is the one just saved. When those steps
    belong to an abandoned timeline (a resume fell back past them), ``discard_newer=True``
    deletes them, and an earlier commit of ``step`` itself, once this step is committed. A
    concurrent or stale writer on the same root loses with ``CommitConflictError`` (see
    [Note: one writer per step, one timeline] in ``storage/_commit.py``).
    """
    global _previous
    start = time.perf_counter()
    options = options or SaveOptions()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 or None")
    _wait_previous()
    group = resolve_group(process_group)
    rank, _ = rank_world(group)
    store = Store(url, storage_options, options.io)

    # Every rank reaches the gather even when its own state is bad, so errors never hang.
    meta: dict[str, Any] = {"error": None}
    local_error: Exception | None = None
    lineage: Lineage | None = None
    try:
        tensors, values = flatten_state(state)
        meta["tensors"] = [
            [n, list(t.shape), dtype_name(t.dtype), t.range.offset, t.range.length]
            for n, t in sorted(tensors.items())
        ]
        meta["values"] = {n: v.value for n, v in values.items()}
        if rank == 0:  # decides for every rank, before anything is written
            lineage = plan_lineage(store, step, discard_newer)
            meta["attempt"], meta["replaces"] = fresh_attempt(), lineage.replaces
    except Exception as e:
        local_error, meta["error"] = e, f"{type(e).__name__}: {e}"
    metas = all_gather_json(meta, group)
    if local_error is not None:
        raise local_error
    for r, m in enumerate(metas):
        if m["error"]:
            raise CheckpointError(f"save of step {step} failed on rank {r}: {m['error']}")
    plan = make_plan(metas, metas[0]["attempt"], options)

    handle = SaveHandle(step, store.where())
    with _lock:
        _previous = handle
    job = _SaveJob(store, step, rank, plan, metas, tensors, options, keep_last, keep_every)
    job.lineage, job.replaces = lineage, metas[0].get("replaces")
    if async_save:
        job.start(handle)
    else:
        try:
            job.run_inline()
        except BaseException as e:
            handle._observed = True
            handle._finish(e)
            raise
        handle._finish(None)
    handle.blocking_seconds = time.perf_counter() - start
    return handle


class _SaveJob:
    def __init__(
        self,
        store: Store,
        step: int,
        rank: int,
        plan: SavePlan,
        metas: list[dict[str, Any]],
        tensors: dict[str, TensorLeaf],
        options: SaveOptions,
        keep_last: int | None,
        keep_every: int | None,
    ) -> None:
        self.store, self.step, self.rank = store, step, rank
        self.plan, self.metas, self.tensors, self.options = plan, metas, tensors, options
        self.keep_last, self.keep_every = keep_last, keep_every
        self.mine = plan.for_rank(rank)
        self.lineage: Lineage | None = None  # rank 0's view of the root when it planned
        self.replaces: str | None = None

    # -- writing this rank's objects ------------------------------------------------------------

    def _payloads(self, obj: PlannedObject) -> list[torch.Tensor]:
        out = []
        for p in obj.pieces:
            leaf = self.tensors[p.name]
            start = p.offset - leaf.range.offset
            out.append(leaf.local.reshape(-1)[start : start + p.length])  # 1D
        return out

    def _write(self, obj: PlannedObject, payloads: list[torch.Tensor]) -> list[list[int]]:
        result: list[list[int]] = []

        def produce(f: Any) -> None:
            result[:] = write_object(
                f, obj.head, len(payloads), enumerate(payloads), self.options.checksum_block_bytes
            )

        self.store.write(f"{step_dir(self.step)}/{obj.name}", produce)
        return result

    def run_inline(self) -> None:
        futures: list[Future] = []
        error: BaseException | None = None
        with ThreadPoolExecutor(self.options.io.threads, "storage-save") as pool:
            try:
                for obj in self.mine:
                    futures.append(pool.submit(self._write, obj, self._payloads(obj)))
            except BaseException as e:  # still take part in the commit protocol, as a failure
                error = e
            self._finish_and_commit(futures, error)

    def start(self, handle: SaveHandle) -> None:
        """Stage within the budget (blocking), upload and commit in the background."""
        budget = StagingBudget(self.options.staging_budget_bytes)
        reuse = self.options.reuse_staging
        if not reuse:
            _staging_pool.clear()
        pool = ThreadPoolExecutor(self.options.io.threads, "storage-save")
        futures: list[Future] = []
        error: BaseException | None = None

        def upload(obj: PlannedObject, staged: list[torch.Tensor], buf: torch.Tensor) -> Any:
            try:
                return self._write(obj, staged)
            finally:
                budget.release(obj.payload_bytes)
                if reuse:
                    _staging_pool.give(buf, self.options.staging_budget_bytes)

        kinds = set()
        try:
            for obj in self.mine:
                budget.acquire(obj.payload_bytes)
                staged, buf = stage(self._payloads(obj), _staging_pool if reuse else None)
                kinds.add((buf.numel(), buf.is_pinned()))
                futures.append(pool.submit(upload, obj, staged, buf))
        except BaseException as e:  # still take part in the commit protocol, as a failure
            error = e
        _staging_pool.clear(keep=kinds)  # buffers of earlier, other states: free them
        handle.staging_peak_bytes = budget.peak

        def background() -> None:
            try:
                self._finish_and_commit(futures, error)
            except BaseException as e:
                handle._finish(e)
            else:
                handle._finish(None)
            finally:
                pool.shutdown(wait=False)

        threading.Thread(target=background, name=f"storage-save-{self.step}", daemon=True).start()

    # -- the commit (storage/_commit.py) ---------------------------------------------------------

    def _finish_and_commit(self, futures: list[Future], error: BaseException | None) -> None:
        crcs: dict[str, list[list[int]]] = {}
        for obj, fut in zip(self.mine, futures, strict=False):
            try:
                crcs[obj.name] = fut.result()
            except BaseException as e:
                error = error or e
        finish(
            self.store,
            self.step,
            self.plan,
            self.rank,
            crcs,
            error,
            rank_values=[m["values"] for m in self.metas],
            checksum_block_bytes=self.options.checksum_block_bytes,
            timeout_s=self.options.commit_timeout_s,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            lineage=self.lineage,
            replaces=self.replaces,
        )
