"""[Note: saving for other processes] One process writes and commits a step whose tensors other
processes' ranks copied into files it can read (the snapshot persister of ``ftsdp.checkpoint``).
The plan is the distributed save's own: the exchange, run for every rank on threads of this
process, so that the objects, their names and the manifest are those the ranks' own ``save``
would have made; the objects' bytes come ready laid out (header and payload), one file each.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._dtypes import dtype_name, torch_dtype
from ftsdp.storage.format._layout import manifest_path, step_dir
from ftsdp.storage.format._objects import PlannedObject
from ftsdp.storage.format._ranges import Range
from ftsdp.storage.format._safetensors import write_object
from ftsdp.storage.format._state import TensorLeaf, flatten_state, json_copy
from ftsdp.storage.format._steps import Known
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving._commit import (
    Reports,
    absent,
    commit,
    drop,
    fresh_attempt,
    plan_lineage,
    report_of,
)
from ftsdp.storage.saving._exchange import exchange
from ftsdp.storage.saving._save_plan import SavePlan

Rows = list[list[Any]]  # a rank's tensors: [name, shape, dtype name, offset, length, layout, grid]


def describe(state: Any) -> tuple[dict[str, TensorLeaf], dict[str, Any]]:
    """``state``'s tensor leaves and a JSON copy of its values (name -> value), as a save sees
    them."""
    tensors, values = flatten_state(state)
    return tensors, json_copy(values)


def leaf_rows(leaves: dict[str, TensorLeaf]) -> Rows:
    """A rank's tensor leaves as JSON rows, for :func:`plan_for_ranks` in another process."""
    return [
        [n, list(t.shape), dtype_name(t.dtype), t.range.offset, t.range.length, t.layout, t.grid]
        for n, t in sorted(leaves.items())
    ]


def _grid(rest: list[Any]) -> tuple[tuple[int, ...], ...] | None:
    """The grid of a row (its seventh item; rows written before grids have six)."""
    grid = rest[0] if rest else None
    return None if grid is None else tuple(tuple(int(c) for c in cuts) for cuts in grid)


class _ThreadWire:
    """The exchange's collectives between the threads of one process, one per rank (the
    ``group`` argument is the thread's rank). Values are copied, as over a real wire."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world

    def _all(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = copy.deepcopy(value)
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def rank_world(self, group: int) -> tuple[int, int]:
        return group, self.world

    def broadcast_json(self, obj: Any, group: int) -> Any:
        return self._all(group, obj)[0]

    def all_reduce_max(self, values: list[int], group: int) -> list[int]:
        return [max(column) for column in zip(*self._all(group, values), strict=True)]

    def all_gather_json(self, obj: Any, group: int) -> list[Any]:
        return self._all(group, obj)

    def gather_json(self, obj: Any, group: int) -> list[Any] | None:
        gathered = self._all(group, obj)
        return gathered if group == 0 else None

    def scatter_json(self, objs: list[Any] | None, group: int) -> Any:
        return self._all(group, objs)[0][group]


def plan_for_ranks(
    rows: Sequence[Rows],
    step: int,
    options: SaveOptions,
    attempt: str = "0" * 8,
    replaces: str | None = None,
) -> list[SavePlan]:
    """Every rank's plan of ``step`` (``rows[r]``: rank r's :func:`leaf_rows`), as the ranks'
    exchange makes it; raises its error (the same for every rank) when the rows do not fit."""
    world = len(rows)
    wire = _ThreadWire(world)
    plans: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def run(rank: int) -> None:
        leaves = {
            name: TensorLeaf(
                name,
                tuple(shape),
                torch_dtype(dtype),
                Range(offset, length),
                torch.empty(0, device="meta"),  # the exchange reads no values
                None if layout is None else (int(layout[0]), int(layout[1])),
                _grid(rest),
            )
            for name, shape, dtype, offset, length, layout, *rest in rows[rank]
        }
        meta: dict[str, Any] = {"error": None, "values": {}}
        if rank == 0:
            meta["attempt"], meta["replaces"] = attempt, replaces
        try:
            group: Any = rank  # the wire's group: the thread's rank
            plans[rank] = exchange(leaves, meta, group, step, options, wire)[0]
        except BaseException as e:
            errors[rank] = e
            wire.barrier.abort()  # a rank that fails alone leaves no other waiting

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raised = [e for e in errors if e is not None]
    if raised:  # a rank's own error first: the others' broken barrier is its consequence
        raise min(raised, key=lambda e: isinstance(e, threading.BrokenBarrierError))
    return plans


class _Discard:
    """A file that keeps nothing: what ``write_object`` checksums, unwritten."""

    def write(self, data: Any) -> int:
        return len(data)


def object_checksums(obj: PlannedObject, data: memoryview, block_bytes: int) -> list[list[int]]:
    """Each piece's per-block checksums of object ``obj`` laid out in ``data`` (its whole file),
    exactly as a save writing it computes them."""
    if len(data) != obj.size or bytes(data[: len(obj.head)]) != obj.head:
        raise CheckpointError(f"{obj.name}: its bytes are not laid out as planned")
    chunks = ((i, data[s:e]) for i, (s, e) in enumerate(obj.byte_ranges))
    return write_object(_Discard(), obj.head, len(obj.pieces), chunks, block_bytes)  # type: ignore[arg-type]


class RootForRanks:
    """One root that this process saves every rank's steps to (what it learned of the root kept
    from one save to the next, as a rank's own saves keep it)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.store = Store(url, storage_options)
        self.known = Known()

    def begin(self, step: int, rows: Sequence[Rows], options: SaveOptions) -> StepForRanks:
        """A save of ``step`` once the root's checks pass (``plan_lineage``)."""
        return StepForRanks(self, step, rows, options)


class StepForRanks:
    """One step of every rank written and committed by this process: each object either goes
    to the root (:meth:`write`) or, on a local root, is linked from its file (:meth:`link`);
    then :meth:`commit` with each rank's checksums and values. Used as a context manager, a
    step that fails before it is committed removes what it placed (:meth:`abandon`)."""

    def __init__(
        self, root: RootForRanks, step: int, rows: Sequence[Rows], options: SaveOptions
    ) -> None:
        self.store, self.step, self.options, self.known = root.store, step, options, root.known
        self.lineage = plan_lineage(self.store, step, options.discard_newer, self.known)
        self.plans = plan_for_ranks(rows, step, options, fresh_attempt(), self.lineage.replaces)
        self.placed: list[str] = []  # the objects written or linked so far (by any thread)
        self.committing = False  # from here on this attempt's manifest may exist

    def __enter__(self) -> StepForRanks:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if isinstance(error, Exception):  # not on the way out (KeyboardInterrupt)
            self.abandon()

    def abandon(self) -> None:
        """Best effort, once no write is in flight: remove the objects this step placed and its
        directory if that leaves it empty, unless its manifest may exist (then it committed and
        they are the step's). A failed memory commit so frees the slot files' old bytes its
        links kept alive, and a failed durable one the room its objects took."""
        if self.committing and not absent(self.store, manifest_path(self.step)):
            return
        drop(self.store, self.step, self.placed)
        with contextlib.suppress(Exception):
            self.store.remove_empty_dir(step_dir(self.step))

    def objects(self, rank: int) -> list[PlannedObject]:
        """Rank ``rank``'s objects, in the order of its files."""
        return self.plans[rank].own(rank)

    def write(self, obj: PlannedObject, data: memoryview, checksums: bool) -> list[list[int]]:
        """Object ``obj`` from ``data`` (its whole file) to the root; with ``checksums``, its
        checksums, computed as it is written (else ``[]``: the caller has them)."""
        crcs: list[list[int]] = []

        def produce(f: Any) -> None:
            if not checksums:
                f.write(data)
                return
            chunks = ((i, data[s:e]) for i, (s, e) in enumerate(obj.byte_ranges))
            block = self.options.checksum_block_bytes
            crcs[:] = write_object(f, obj.head, len(obj.pieces), chunks, block)

        self.store.write(f"{step_dir(self.step)}/{obj.name}", produce)
        self.placed.append(obj.name)
        return crcs

    def link(self, obj: PlannedObject, path: str) -> None:
        """Object ``obj`` as a hard link to file ``path`` (a local root on its filesystem)."""
        folder = os.path.join(self.store.root, step_dir(self.step))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        os.link(path, os.path.join(folder, obj.name))
        self.placed.append(obj.name)

    def commit(self, crcs: Sequence[dict[str, list[list[int]]]], values: Sequence[dict]) -> None:
        """Commit the step with ``crcs[r]`` (object name -> checksums) and ``values[r]`` of each
        rank, applying retention (``SaveOptions.keep_last`` / ``keep_every``)."""
        plans = self.plans
        reports = Reports(plans[0], self.step, len(plans), crcs[0], values[0])
        for r in range(1, len(plans)):
            reports.take(r, report_of(plans[r], r, crcs[r], values[r]))
        self.committing = True
        commit(
            self.store,
            reports.manifest(self.options.checksum_block_bytes),
            keep_last=self.options.keep_last,
            keep_every=self.options.keep_every,
            lineage=self.lineage,
            known=self.known,
        )
