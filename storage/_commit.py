"""The commit protocol of the native format (docs/design.md, "The commit protocol"): its one owner.

Every writer of the format makes a step committed here, by the same code:

- the distributed ``save``: rank 0 draws the attempt (``new_attempt``) before the plan is
  gathered; after writing its objects every rank calls ``finish``: ranks > 0 report through a
  done marker and wait, rank 0 collects the markers and commits (or aborts);
- the single-process writer behind ``convert`` and ``reshard``, which lays a step out for any
  world size but is its only writer (no other ranks, so no markers): ``new_attempt``, write the
  objects, then ``commit(store, build_manifest(...))``.

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
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import LATEST, abort_marker, done_marker, manifest_path, step_dir
from ftsdp.storage._manifest import Manifest, Piece, TensorEntry
from ftsdp.storage._save_plan import SavePlan
from ftsdp.storage._steps import committed_steps, retain

Crcs = dict[str, list[list[int]]]  # object name -> per piece, its per-block crc32 list
_DONE = re.compile(r"^_done-([0-9a-f]+)-rank(\d+)\.json$")  # not the temporary files of a write


def new_attempt(store: Store, step: int) -> str:
    """A fresh attempt id for a save of ``step``; FileExistsError when it is already committed
    (a committed step is never overwritten)."""
    if store.exists(manifest_path(step)):
        raise FileExistsError(
            f"step {step} is already committed at {store.where(step_dir(step))}; "
            "save under another step or delete that one first"
        )
    return uuid.uuid4().hex[:8]


def build_manifest(
    plan: SavePlan,
    crcs: Crcs,
    *,
    step: int,
    world_size: int,
    checksum_block_bytes: int,
    values: dict[str, Any],
    rank_values: list[dict[str, Any]],
) -> Manifest:
    """The manifest of a step written by ``plan``, given every object's checksums.

    ``rank_values[r]`` are rank r's values; only those that differ from ``values`` are kept, for
    the ``world_size`` ranks of the layout (missing ranks have none).
    """
    pieces: dict[str, list[Piece]] = {name: [] for name in plan.shapes}
    for obj in plan.objects:
        for p, (start, end), crc in zip(obj.pieces, obj.byte_ranges, crcs[obj.name], strict=True):
            pieces[p.name].append(
                Piece(obj.name, p.key, p.offset, p.length, start, end, tuple(crc))
            )
    ranks = [dict(rank_values[r]) if r < len(rank_values) else {} for r in range(world_size)]
    return Manifest(
        step=step,
        world_size=world_size,
        attempt=plan.attempt,
        checksum_block_bytes=checksum_block_bytes,
        objects={o.name: o.size for o in plan.objects},
        tensors={
            name: TensorEntry(shape, dtype, tuple(sorted(pieces[name], key=lambda p: p.offset)))
            for name, (shape, dtype) in plan.shapes.items()
        },
        values=values,
        rank_values=[
            {k: v for k, v in r.items() if k not in values or values[k] != v} for r in ranks
        ],
    )


def commit(
    store: Store, manifest: Manifest, *, keep_last: int | None = None, keep_every: int | None = None
) -> None:
    """Write the manifest: the commit. Then, as a best effort (the step is saved; a failure is a
    warning): ``latest`` when this is the newest committed step, removal of the attempt's done
    markers, and retention when ``keep_last`` is given."""
    step = manifest.step
    store.write_bytes(manifest_path(step), manifest.to_json())  # the commit
    try:
        steps = committed_steps(store)
        if steps and steps[-1] == step:
            store.write_bytes(LATEST, f"{step}\n".encode())
        for name in store.listdir(step_dir(step)):  # a single writer has none
            m = _DONE.match(name)
            if m is not None and m.group(1) == manifest.attempt:
                store.remove(f"{step_dir(step)}/{name}")
        if keep_last is not None:
            retain(store, keep_last, keep_every)
    except Exception as e:
        warnings.warn(
            f"step {step} committed at {store.where()}, but updating 'latest' or retention "
            f"failed: {type(e).__name__}: {e}",
            stacklevel=2,
        )


# -- several ranks ------------------------------------------------------------------------------


def finish(
    store: Store,
    step: int,
    plan: SavePlan,
    rank: int,
    crcs: Crcs,
    error: BaseException | None,
    *,
    rank_values: list[dict[str, Any]],
    checksum_block_bytes: int,
    timeout_s: float,
    keep_last: int | None = None,
    keep_every: int | None = None,
) -> None:
    """Steps 3 to 5 of the protocol on ``rank``, once it wrote its objects of ``plan`` (their
    checksums: ``crcs``) or failed (``error``). Returns when the step is committed; raises on
    every rank when it is not. ``rank_values`` holds every rank's values (its length is the
    world size)."""
    if rank != 0:  # report, then wait for rank 0's verdict
        objects = {o.name: {"size": o.size, "crc32": crcs.get(o.name)} for o in plan.for_rank(rank)}
        _write_marker(
            store, done_marker(step, plan.attempt, rank), error, rank=rank, objects=objects
        )
        if error is not None:
            raise error
        _wait_for_commit(store, step, plan.attempt, rank, timeout_s)
        return
    if error is None:
        try:
            crcs = {**crcs, **_collect_markers(store, step, plan, len(rank_values), timeout_s)}
            manifest = build_manifest(
                plan,
                crcs,
                step=step,
                world_size=len(rank_values),
                checksum_block_bytes=checksum_block_bytes,
                values=rank_values[0],
                rank_values=rank_values,
            )
            commit(store, manifest, keep_last=keep_last, keep_every=keep_every)
            return
        except BaseException as e:
            error = e
    with contextlib.suppress(Exception):  # best effort: the original error is what matters
        _write_marker(store, abort_marker(step, plan.attempt), error)
    raise error


def _write_marker(store: Store, rel: str, error: BaseException | None, **fields: Any) -> None:
    """A done marker (rank > 0: its objects' sizes and checksums, or its error) or an abort
    marker (rank 0: the error), as JSON."""
    doc = {**fields, "error": None if error is None else f"{type(error).__name__}: {error}"}
    store.write_bytes(rel, json.dumps(doc).encode())


def _wait_for_commit(store: Store, step: int, attempt: str, rank: int, timeout_s: float) -> None:
    """Rank > 0: wait for the manifest, or for rank 0's abort marker (raised)."""
    abort = abort_marker(step, attempt)
    for _ in _poll(timeout_s):
        if store.exists(manifest_path(step)):
            return
        if store.exists(abort):
            reason = json.loads(store.read(abort)).get("error")
            raise CheckpointError(
                f"save of step {step} to {store.where()} was aborted by rank 0: {reason}"
            )
    raise TimeoutError(
        f"rank {rank}: step {step} at {store.where()} was not committed within {timeout_s}s "
        "(is rank 0 alive?)"
    )


def _collect_markers(store: Store, step: int, plan: SavePlan, world: int, timeout_s: float) -> Crcs:
    """Rank 0: every other rank's checksums, from its done marker, each size checked against the
    plan; raises a rank's reported error, or TimeoutError."""
    crcs: Crcs = {}
    waiting = set(range(1, world))
    for _ in _poll(timeout_s):
        listing = store.listdir(step_dir(step)) if waiting else {}
        for name in sorted(listing):
            m = _DONE.match(name)
            if m is None or m.group(1) != plan.attempt or int(m.group(2)) not in waiting:
                continue
            rank = int(m.group(2))
            marker = json.loads(store.read(done_marker(step, plan.attempt, rank)))
            if marker["error"]:
                raise CheckpointError(f"rank {rank} failed to write step {step}: {marker['error']}")
            for obj in plan.for_rank(rank):
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
        f"step {step} at {store.where()}: ranks {sorted(waiting)} did not finish writing within "
        f"{timeout_s}s"
    )


def _poll(timeout: float) -> Iterator[int]:
    """Yield until ``timeout`` seconds have passed, sleeping a little longer each time."""
    deadline, delay, n = time.monotonic() + timeout, 0.005, 0
    while True:
        yield n
        if time.monotonic() > deadline:
            return
        time.sleep(delay)
        delay, n = min(delay * 1.5, 0.25), n + 1
