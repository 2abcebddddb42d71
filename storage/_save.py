"""``save``: plan collectively, write this rank's objects, commit (see docs/format.md).

[Note: commit without collectives in the background]
After the planning all-gather (on the caller's thread, where every rank calls ``save`` in the
same order) no collective is used: a rank > 0 writes its objects, then a small done-marker
object with its sizes and checksums; rank 0 waits for every marker, writes the manifest (the
commit) and the ``latest`` marker. A failure becomes an error marker (rank > 0) or an abort
marker (rank 0), so every rank fails the same save instead of hanging; a silent rank is a
timeout. This works the same whether the upload runs inline or in a background thread, so
async save cannot deadlock with the training loop's collectives.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ftsdp.storage._collectives import all_gather_json, rank_world, resolve_group
from ftsdp.storage._dtypes import dtype_name
from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import LATEST, abort_marker, done_marker, manifest_path, step_dir
from ftsdp.storage._manifest import Manifest, Piece, TensorEntry
from ftsdp.storage._options import SaveOptions
from ftsdp.storage._safetensors import write_object
from ftsdp.storage._save_plan import PlannedObject, SavePlan, make_plan
from ftsdp.storage._staging import StagingBudget, StagingPool, stage
from ftsdp.storage._state import TensorLeaf, flatten_state
from ftsdp.storage._steps import committed_steps, retain

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
) -> SaveHandle:
    """Save ``state`` as step ``step`` under ``url``; collective over ``process_group``.

    Leaves of ``state`` are tensors (whole, identical on every rank that holds them), DTensors,
    ``FlatShard``s or JSON-able values. Returns when committed, or with ``async_save=True`` as
    soon as this rank's pieces are staged in host memory (``handle.wait()`` for the commit).
    With ``keep_last`` rank 0 applies retention after the commit (see ``apply_retention``).
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
    rank, world = rank_world(group)
    store = Store(url, storage_options, options.io)

    # Every rank reaches the gather even when its own state is bad, so errors never hang.
    meta: dict[str, Any] = {"error": None}
    local_error: Exception | None = None
    try:
        tensors, values = flatten_state(state)
        meta["tensors"] = [
            [n, list(t.shape), dtype_name(t.dtype), t.range.offset, t.range.length]
            for n, t in sorted(tensors.items())
        ]
        meta["values"] = {n: v.value for n, v in values.items()}
        if rank == 0:
            meta["attempt"] = uuid.uuid4().hex[:8]
            if store.exists(manifest_path(step)):
                raise FileExistsError(
                    f"step {step} is already committed at {store.where(step_dir(step))}; "
                    "save under another step or delete that one first"
                )
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
    job = _SaveJob(store, step, rank, world, plan, metas, tensors, options, keep_last, keep_every)
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
        world: int,
        plan: SavePlan,
        metas: list[dict[str, Any]],
        tensors: dict[str, TensorLeaf],
        options: SaveOptions,
        keep_last: int | None,
        keep_every: int | None,
    ) -> None:
        self.store, self.step, self.rank, self.world = store, step, rank, world
        self.plan, self.metas, self.tensors, self.options = plan, metas, tensors, options
        self.keep_last, self.keep_every = keep_last, keep_every
        self.mine = plan.for_rank(rank)

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
            result[:] = write_object(f, obj.head, payloads, self.options.checksum_block_bytes)

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

    # -- commit protocol (see the note at the top) ------------------------------------------------

    def _finish_and_commit(self, futures: list[Future], error: BaseException | None) -> None:
        crcs: dict[str, list[list[int]]] = {}
        for obj, fut in zip(self.mine, futures, strict=False):
            try:
                crcs[obj.name] = fut.result()
            except BaseException as e:
                error = error or e
        if self.rank != 0:
            self._report_and_wait(crcs, error)
            return
        if error is None:
            try:
                crcs.update(self._collect_markers())
                self._commit(crcs)
                return
            except BaseException as e:
                error = e
        self._abort(error)
        raise error

    def _report_and_wait(
        self, crcs: dict[str, list[list[int]]], error: BaseException | None
    ) -> None:
        marker = {
            "rank": self.rank,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "objects": {o.name: {"size": o.size, "crc32": crcs.get(o.name)} for o in self.mine},
        }
        self.store.write_bytes(
            done_marker(self.step, self.plan.attempt, self.rank), json.dumps(marker).encode()
        )
        if error is not None:
            raise error
        abort = abort_marker(self.step, self.plan.attempt)
        for _ in _poll(self.options.commit_timeout_s):
            if self.store.exists(manifest_path(self.step)):
                return
            if self.store.exists(abort):
                reason = json.loads(self.store.read(abort)).get("error")
                raise CheckpointError(
                    f"save of step {self.step} to {self.store.where()} was aborted by rank 0: {reason}"
                )
        raise TimeoutError(
            f"rank {self.rank}: step {self.step} at {self.store.where()} was not committed within "
            f"{self.options.commit_timeout_s}s (is rank 0 alive?)"
        )

    def _collect_markers(self) -> dict[str, list[list[int]]]:
        crcs: dict[str, list[list[int]]] = {}
        waiting = set(range(1, self.world))
        pattern = re.compile(rf"^_done-{self.plan.attempt}-rank(\d+)\.json$")  # not temp files
        for _ in _poll(self.options.commit_timeout_s):
            listing = self.store.listdir(step_dir(self.step)) if waiting else {}
            for name in sorted(listing):
                m = pattern.match(name)
                if m is None or int(m.group(1)) not in waiting:
                    continue
                rank = int(m.group(1))
                marker = json.loads(
                    self.store.read(done_marker(self.step, self.plan.attempt, rank))
                )
                if marker["error"]:
                    raise CheckpointError(
                        f"rank {rank} failed to write step {self.step}: {marker['error']}"
                    )
                for obj in self.plan.for_rank(rank):
                    got = marker["objects"].get(obj.name, {})
                    if got.get("size") != obj.size or got.get("crc32") is None:
                        raise CheckpointError(
                            f"rank {rank} reported {got.get('size')} bytes for {obj.name}, "
                            f"the plan says {obj.size}"
                        )
                    crcs[obj.name] = got["crc32"]
                waiting.discard(rank)
            if not waiting:
                return crcs
        raise TimeoutError(
            f"step {self.step} at {self.store.where()}: ranks {sorted(waiting)} did not finish "
            f"writing within {self.options.commit_timeout_s}s"
        )

    def _commit(self, crcs: dict[str, list[list[int]]]) -> None:
        pieces: dict[str, list[Piece]] = {name: [] for name in self.plan.shapes}
        for obj in self.plan.objects:
            for p, (start, end), crc in zip(
                obj.pieces, obj.byte_ranges, crcs[obj.name], strict=True
            ):
                pieces[p.name].append(
                    Piece(obj.name, p.key, p.offset, p.length, start, end, tuple(crc))
                )
        values = self.metas[0]["values"]
        manifest = Manifest(
            step=self.step,
            world_size=self.world,
            attempt=self.plan.attempt,
            checksum_block_bytes=self.options.checksum_block_bytes,
            objects={o.name: o.size for o in self.plan.objects},
            tensors={
                name: TensorEntry(shape, dtype, tuple(sorted(pieces[name], key=lambda p: p.offset)))
                for name, (shape, dtype) in self.plan.shapes.items()
            },
            values=values,
            rank_values=[
                {k: v for k, v in m["values"].items() if k not in values or values[k] != v}
                for m in self.metas
            ],
        )
        self.store.write_bytes(manifest_path(self.step), manifest.to_json())  # the commit
        try:  # after the commit: failures here are warnings, the step is saved
            steps = committed_steps(self.store)
            if steps and steps[-1] == self.step:
                self.store.write_bytes(LATEST, f"{self.step}\n".encode())
            for rank in range(1, self.world):
                self.store.remove(done_marker(self.step, self.plan.attempt, rank))
            if self.keep_last is not None:
                retain(self.store, self.keep_last, self.keep_every)
        except Exception as e:
            warnings.warn(
                f"step {self.step} committed at {self.store.where()}, but updating 'latest' or "
                f"retention failed: {type(e).__name__}: {e}",
                stacklevel=1,
            )

    def _abort(self, error: BaseException) -> None:
        # Best effort: the original error is what the caller needs to see.
        with contextlib.suppress(Exception):
            self.store.write_bytes(
                abort_marker(self.step, self.plan.attempt),
                json.dumps({"error": f"{type(error).__name__}: {error}"}).encode(),
            )


def _poll(timeout: float):
    """Yield until ``timeout`` seconds have passed, sleeping a little longer each time."""
    deadline, delay, n = time.monotonic() + timeout, 0.005, 0
    while True:
        yield n
        if time.monotonic() > deadline:
            return
        time.sleep(delay)
        delay, n = min(delay * 1.5, 0.25), n + 1
