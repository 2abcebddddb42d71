"""The commit protocol of the native format, its one owner (docs/design.md, "The commit protocol";
docs/format.md, "Commit protocol"): the distributed ``save`` (``new_attempt`` on rank 0, then
``finish`` on every rank) and the single-process writer of ``convert`` and ``reshard``
(``new_attempt``, its objects, then ``commit(store, build_manifest(...))``). After the planning
exchange no collective is used (markers instead)."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import struct
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import MAX_MANIFEST_BYTES
from ftsdp.storage.format._layout import (
    LATEST,
    MANIFEST,
    abort_marker,
    done_marker,
    manifest_path,
    object_name,
    step_dir,
)
from ftsdp.storage.format._manifest import (
    Manifest,
    Piece,
    RegularIndex,
    TensorEntry,
    manifest_version,
)
from ftsdp.storage.format._steps import (
    Known,
    RootScan,
    StepDir,
    remove_attempt,
    remove_step,
    retain,
    scan_root,
)
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving._save_plan import SavePlan

Crcs = dict[str, list[list[int]]]  # object name -> per piece, its per-block checksums
_GUARDS: list[Callable[[], None]] = []  # run before every commit of this process (guard_commits)


def guard_commits(check: Callable[[], None]) -> Callable[[], None]:
    """Call ``check()`` first in every commit this process makes (any root, any thread) until
    the returned function is called. ``check`` refuses the commit by raising (the save fails on
    every rank) or ends the process: a worker whose launcher is gone must commit nothing
    (docs/elastic.md, "A worker without its agent")."""
    _GUARDS.append(check)
    return lambda: _GUARDS.remove(check) if check in _GUARDS else None


_DONE = re.compile(r"^_done-([0-9a-f]+)-rank(\d+)\.json$")  # not the temporary files of a write
_ATTEMPT = re.compile(rb'"attempt"\s*:\s*"([0-9a-f]{1,64})"')  # in a manifest's first bytes
_HEAD_BYTES = 4096

logger = logging.getLogger(__name__)


class CommitConflictError(CheckpointError, FileExistsError):
    """Another writer committed this step first, or committed other steps under the root while
    this save was in progress (a stale or concurrent writer): this save is not committed."""


@dataclass(frozen=True)
class Lineage:
    """What rank 0 found under the root when it planned a save of ``step`` (``plan_lineage``)."""

    step: int
    seen: frozenset[int]  # steps whose manifest existed (valid or not)
    discard: dict[int, str] = field(default_factory=dict)  # newer committed steps -> attempt
    replaces: str | None = None  # the attempt of an earlier commit of ``step`` being replaced


def plan_lineage(
    store: Store, step: int, discard_newer: bool = False, known: Known | None = None
) -> Lineage:
    """Check, before anything is written, that ``step`` is not committed and no committed step is
    newer, unless ``discard_newer`` (those are deleted once ``step`` is committed). Raises
    FileExistsError (``step`` committed, or a foreign manifest) or CheckpointError (newer steps).
    ``known``: what this saver learned of the root (``scan_root``)."""
    if store.is_link(step_dir(step)):
        raise FileExistsError(
            f"{store.where(step_dir(step))} is a link; a step is never written through a link"
        )
    if known is not None:  # read as they are now (there are none, but on a refusal or discard)
        for s in [s for s in known.manifests if s >= step]:
            del known.manifests[s]
    scan = scan_root(store, read=lambda s: s >= step, known=known)  # reads only these
    newer = {s: d.manifest.attempt for s, d in scan.dirs.items() if d.manifest and s > step}
    own = scan.dirs.get(step)
    replaces = None
    if own is not None and own.has_manifest:
        if own.manifest is None:
            raise FileExistsError(
                f"{store.where(manifest_path(step))} exists but is not a committed step of this "
                f"format ({own.problem}); it is never overwritten or deleted: move it away or "
                "save under another step"
            )
        if not discard_newer:
            raise FileExistsError(
                f"step {step} is already committed at {store.where(step_dir(step))}; save under "
                "another step or delete that one first (SaveOptions(discard_newer=True) replaces it "
                "when it belongs to an abandoned timeline)"
            )
        replaces = own.manifest.attempt
    if newer and not discard_newer:
        raise CheckpointError(
            f"refusing to save step {step} under {store.where()}: committed steps newer than it "
            f"exist: {sorted(newer)}. They would stay the newest (a resume would load them, "
            "retention would keep them over this step). Pass SaveOptions(discard_newer=True) to "
            f"delete them once step {step} is committed (CheckpointManager does when its resume "
            "fell back past them), resume from the newest step instead, or delete them first"
        )
    return Lineage(step, frozenset(scan.with_manifest), newer, replaces)


def new_attempt(store: Store, step: int) -> str:
    """A fresh attempt id for a save of ``step`` once ``plan_lineage``'s checks pass."""
    plan_lineage(store, step)
    return fresh_attempt()


def fresh_attempt() -> str:
    """A new attempt id: 8 hex digits (object and marker names carry it)."""
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
    regular: tuple[list[int], dict[str, int]] | None = None,
) -> Manifest:
    """The manifest of a step written by ``plan``, given every object's checksums.

    ``rank_values[r]``: rank r's values (only those differing from ``values`` are kept).
    ``regular``: ``(counts, sizes)`` of each rank's regular objects, with ``plan.regular``
    (the manifest is then version 4).
    """
    pieces: dict[str, list[Piece]] = {name: [] for name in plan.shapes}
    for obj in plan.objects:
        for p, (start, end), crc in zip(obj.pieces, obj.byte_ranges, crcs[obj.name], strict=True):
            pieces[p.name].append(
                Piece(obj.name, p.key, p.offset, p.length, start, end, tuple(crc))
            )
    ranks = [dict(rank_values[r]) if r < len(rank_values) else {} for r in range(world_size)]
    objects = {o.name: o.size for o in plan.objects}
    tensors = {
        name: TensorEntry(
            shape,
            dtype,
            tuple(sorted(pieces[name], key=lambda p: p.offset)),
            grid=plan.grids.get(name),
        )
        for name, (shape, dtype) in plan.shapes.items()
    }
    index = None
    if plan.regular is not None and regular is not None:
        counts, sizes = regular
        objects.update(sizes)
        blobs = []
        for rank, count in enumerate(counts):
            flat = [
                c
                for i in range(count)
                for piece in crcs[object_name(rank, i, plan.attempt)]
                for c in piece
            ]
            blobs.append(base64.b64encode(struct.pack(f"<{len(flat)}I", *flat)).decode())
        index = RegularIndex(
            plan.regular,
            tuple(counts),
            tuple(blobs),
            attempt=plan.attempt,
            step=step,
            block=checksum_block_bytes,
            objects=objects,
        )
        for name, shape, dtype, rule in plan.regular.entries:
            tensors[name] = TensorEntry(shape, dtype, (), rule, name, index, plan.grids.get(name))
    return Manifest(
        step=step,
        world_size=world_size,
        attempt=plan.attempt,
        checksum_block_bytes=checksum_block_bytes,
        objects=objects,
        tensors=tensors,
        values=values,
        rank_values=[
            {k: v for k, v in r.items() if k not in values or values[k] != v} for r in ranks
        ],
        version=manifest_version(tensors, index),
        regular=index,
    )


def commit(
    store: Store,
    manifest: Manifest,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    lineage: Lineage | None = None,
    present: Collection[str] | None = None,
    known: Known | None = None,
) -> None:
    """Create the manifest exclusively: the commit, once the checks of ``guard_commits`` pass.
    With ``lineage`` (``plan_lineage``), a step committed by another writer meanwhile removes
    this attempt's files and raises ``CommitConflictError``. Then, best effort (a failure is a
    warning): the steps ``lineage`` discards, ``latest``, the done markers, and retention when
    ``keep_last`` is given. ``present``: the only objects checked before the commit (a
    node-local root holds some). ``known``: what this saver learned of the root (kept up to
    date here), so that the commit lists no step directory it knows and reads no manifest it
    knows: a constant number of requests whatever the steps (docs/format.md, "Requests")."""
    for check in list(_GUARDS):
        check()
    step, attempt = manifest.step, manifest.attempt
    rel, data = manifest_path(step), manifest.to_json()
    own = None
    if lineage is not None:
        before = scan_root(store, read=lambda s: False, known=known)
        _check_no_other_writer(store, lineage, attempt, committed=False, steps=before)
        own = before.dirs.get(step)
        # An earlier commit of this step that is being replaced: take it down first.
        if lineage.replaces is not None and _attempt_at(store, step) == lineage.replaces:
            store.remove(rel)
            own = None
            if known is not None:
                known.manifests.pop(step, None)
    listing = own.entries if own is not None and own.listed else store.listdir(step_dir(step))
    gone = sorted(
        n
        for n, size in manifest.objects.items()
        if listing.get(n, ("", -1))[1] != size and (present is None or n in present)
    )
    if gone:  # a manifest exists only over complete objects (deleted meanwhile: a concurrent gc?)
        raise CheckpointError(
            f"step {step} at {store.where(step_dir(step))}: objects of this save are missing or "
            f"have another size before the commit ({', '.join(gone[:3])}"
            f"{', ...' if len(gone) > 3 else ''}); not committed"
        )
    try:
        store.write_exclusive(rel, data)  # the commit
    except FileExistsError as e:
        winner = _attempt_at(store, step)
        if winner != attempt:  # not our own create whose reply was lost and was retried
            _abandon(store, step, attempt)
            # (its manifest may be gone again, or not readable, by now)
            named = "its manifest could not be read" if winner is None else f"attempt {winner}"
            raise CommitConflictError(
                f"step {step} at {store.where(step_dir(step))} was committed by another writer "
                f"({named}) while this save (attempt {attempt}) was in progress; the "
                "committed step is the other writer's, and this save's objects were removed"
            ) from e
    # One scan of the root after the commit serves its check, the markers' removal and the
    # retention (which reads the manifests it does not know; without retention none is read).
    # This step's directory is not listed again: its listing before the commit is current.
    if known is not None:
        known.manifests[step] = manifest
    scan = scan_root(store, read=lambda s: keep_last is not None, known=known)
    if known is not None and step in scan.dirs:
        scan.dirs[step] = StepDir(step, {**listing, MANIFEST: ("file", len(data))}, manifest)
    steps = scan.with_manifest
    if lineage is not None:
        try:
            _check_no_other_writer(store, lineage, attempt, committed=True, steps=scan, data=data)
        except CommitConflictError:
            if known is not None:
                known.manifests.pop(step, None)
            raise
    try:
        changed = False  # by this commit beyond its markers: then retention scans again
        if lineage is not None:
            for newer, newer_attempt in sorted(lineage.discard.items()):
                if known is not None:
                    known.manifests.pop(newer, None)
                left = remove_step(store, newer, attempt=newer_attempt)
                if left:
                    logger.warning("discarding step %d: %s", newer, "; ".join(left))
            if lineage.replaces is not None:
                remove_attempt(store, step, lineage.replaces)
            steps = [s for s in steps if s not in lineage.discard]
            changed = bool(lineage.discard) or lineage.replaces is not None
        if steps and steps[-1] == step:
            store.write_bytes(LATEST, f"{step}\n".encode())
        own = scan.dirs.get(step)
        listing = own.entries if own is not None else store.listdir(step_dir(step))
        for name in sorted(listing):  # a single writer has none
            m = _DONE.match(name)
            if m is not None and m.group(1) == attempt:
                store.remove(f"{step_dir(step)}/{name}")
                listing.pop(name)
        if keep_last is not None:
            retain(
                store,
                keep_last,
                keep_every,
                protect=step,
                scan=scan if not changed else None,
                known=known,
            )
    except Exception as e:
        logger.warning(
            "step %d committed at %s, but updating 'latest', discarding newer steps or "
            "retention failed: %s: %s",
            step,
            store.where(),
            type(e).__name__,
            e,
        )


def _check_no_other_writer(
    store: Store,
    lineage: Lineage,
    attempt: str,
    *,
    committed: bool,
    steps: RootScan,
    data: bytes = b"",
) -> None:
    """CommitConflictError (this attempt's files, and with ``committed`` its manifest ``data``,
    removed first) when another step was committed under the root since the save was planned
    (``steps``: a scan of the root now)."""
    step = lineage.step
    appeared = sorted(set(steps.with_manifest) - lineage.seen - {step})
    if not appeared:
        return
    if committed:  # back our commit out: of two overlapping writers at most one keeps its step
        with contextlib.suppress(Exception):
            if store.read_bounded(manifest_path(step), MAX_MANIFEST_BYTES) == data:
                store.remove(manifest_path(step))
    _abandon(store, step, attempt)
    raise CommitConflictError(
        f"steps {appeared} were committed under {store.where()} by another writer while this "
        f"save of step {step} (attempt {attempt}) was in progress: this writer is stale (e.g. a "
        "rank of an earlier incarnation of the job, stopped and resumed) or another job uses "
        f"the same root. Step {step} was not committed by this save; its objects were removed"
    )


def _abandon(store: Store, step: int, attempt: str) -> None:
    """Best effort: remove every file of ``attempt`` in ``step`` (objects, markers)."""
    try:
        remove_attempt(store, step, attempt)
    except Exception as e:
        logger.warning(
            "could not remove the objects of attempt %s of step %d at %s: %s: %s",
            attempt,
            step,
            store.where(),
            type(e).__name__,
            e,
        )


def _attempt_at(store: Store, step: int) -> str | None:
    """The attempt named by the manifest of ``step`` now (None: none, or not JSON)."""
    rel = manifest_path(step)
    try:
        head = store.read_range(rel, 0, min(store.size(rel), _HEAD_BYTES))
        m = _ATTEMPT.search(head)
        if m is not None:
            return m.group(1).decode()
        doc = json.loads(store.read_bounded(rel, MAX_MANIFEST_BYTES))
    except Exception:
        return None
    return str(doc.get("attempt")) if isinstance(doc, dict) else None


# -- several ranks ------------------------------------------------------------------------------


def finish(
    store: Store,
    step: int,
    plan: SavePlan,
    rank: int,
    crcs: Crcs,
    error: BaseException | None,
    *,
    values: dict[str, Any],
    world_size: int,
    checksum_block_bytes: int,
    timeout_s: float,
    keep_last: int | None = None,
    keep_every: int | None = None,
    lineage: Lineage | None = None,
    replaces: str | None = None,
    known: Known | None = None,
) -> None:
    """Steps 3 to 5 of the protocol on ``rank`` once it wrote its objects (checksums ``crcs``)
    or failed (``error``): returns once committed, raises on every rank otherwise. ``replaces``:
    the attempt of an earlier commit this one replaces; ``known``: see ``commit``."""

    def written() -> list[str]:  # what a failure removes: this rank's objects it wrote
        return [o.name for o in plan.own(rank) if o.name in crcs]

    if rank != 0:  # report, then wait for rank 0's verdict
        report = report_of(plan, rank, crcs, values)
        marker = done_marker(step, plan.attempt, rank)
        try:
            _write_marker(store, marker, error, rank=rank, **report)
        except Exception as e:  # a full disk: make room, then report the failure in brief
            if absent(store, marker):  # else rank 0 may have read it and be committing
                drop(store, step, written())
            with contextlib.suppress(Exception):  # else rank 0 waits until commit_timeout_s
                _write_marker(store, marker, e, rank=rank)
            raise
        if error is not None:  # rank 0 never commits an attempt a rank reported failed
            if isinstance(error, Exception):  # not on the way out (KeyboardInterrupt)
                drop(store, step, written())
            raise error
        _wait_for_commit(store, step, plan.attempt, rank, timeout_s, replaces, written)
        return
    committing = False  # from here on a manifest of this attempt may exist
    if error is None:
        try:
            reports = Reports(plan, step, world_size, crcs, values)
            _collect_markers(store, step, plan, reports, timeout_s)
            manifest = reports.manifest(checksum_block_bytes)
            committing = True
            commit(
                store,
                manifest,
                keep_last=keep_last,
                keep_every=keep_every,
                lineage=lineage,
                known=known,
            )
            return
        except BaseException as e:
            error = e
    if isinstance(error, Exception) and (not committing or absent(store, manifest_path(step))):
        drop(store, step, written())
        if world_size == 1:  # nothing else of the attempt is there
            with contextlib.suppress(Exception):
                store.remove_empty_dir(step_dir(step))
    # Ranks > 0 stop waiting at the abort marker, or at another writer's manifest of this step
    # (then no marker is left in that writer's step). A single rank needs none.
    if world_size > 1 and _attempt_at(store, step) in (None, plan.attempt, replaces):
        with contextlib.suppress(Exception):  # best effort: the original error is what matters
            _write_marker(store, abort_marker(step, plan.attempt), error)
    raise error


def absent(store: Store, rel: str) -> bool:
    """Whether ``rel`` certainly does not exist (False when that cannot be told)."""
    try:
        return not store.exists(rel)
    except Exception:
        return False


def drop(store: Store, step: int, objects: Sequence[str]) -> None:
    """Best effort: remove a rank's ``objects`` (those it wrote) of an attempt that will never be
    committed (each rank removes its own, once it has written them: no rank removes a file
    another may still be writing), so that a retry on a full disk has their room back."""
    try:
        for name in objects:
            store.remove(f"{step_dir(step)}/{name}")
    except Exception as e:  # retention or ``gc`` removes them later
        logger.warning(
            "could not remove the objects of the failed save of step %d at %s: %s: %s",
            step,
            store.where(),
            type(e).__name__,
            e,
        )


def _write_marker(store: Store, rel: str, error: BaseException | None, **fields: Any) -> None:
    """A done marker (rank > 0) or an abort marker (rank 0), as JSON."""
    doc = {**fields, "error": None if error is None else f"{type(error).__name__}: {error}"}
    store.write_bytes(rel, json.dumps(doc).encode())


def _wait_for_commit(
    store: Store,
    step: int,
    attempt: str,
    rank: int,
    timeout_s: float,
    replaces: str | None,
    written: Callable[[], list[str]] = list,
) -> None:
    """Rank > 0: wait for this attempt's manifest; raise at an abort marker (removing this
    rank's objects ``written()`` unless this attempt's manifest exists) or at another writer's
    manifest (but that of the commit this save replaces). A timeout removes nothing: rank 0
    may still commit."""
    abort = abort_marker(step, attempt)
    for _ in _poll(timeout_s):
        names = store.listdir(step_dir(step))  # one request a poll on S3, for both
        if abort.rsplit("/", 1)[-1] in names:
            # Rank 0 may have failed after creating this attempt's manifest (a listing after
            # the commit): then the objects are a committed step's, and stay.
            if MANIFEST not in names or _attempt_at(store, step) not in (None, attempt):
                drop(store, step, written())
            reason = json.loads(store.read_bounded(abort, MAX_MANIFEST_BYTES)).get("error")
            raise CheckpointError(
                f"save of step {step} to {store.where()} was aborted by rank 0: {reason}"
            )
        if MANIFEST in names:
            winner = _attempt_at(store, step)
            if winner == attempt:
                return
            if winner is not None and winner != replaces:
                raise CommitConflictError(
                    f"rank {rank}: step {step} at {store.where(step_dir(step))} was committed by "
                    f"another writer (attempt {winner}), not by this save (attempt {attempt})"
                )
    raise TimeoutError(
        f"rank {rank}: step {step} at {store.where()} was not committed within {timeout_s}s "
        "(is rank 0 alive?)"
    )


def report_of(plan: SavePlan, rank: int, crcs: Crcs, values: dict[str, Any]) -> dict[str, Any]:
    """What rank ``rank`` reports of its objects at the commit (``Reports.take`` reads it)."""
    objects = {o.name: {"size": o.size, "checksums": crcs.get(o.name)} for o in plan.own(rank)}
    return {"objects": objects, "regular": _regular_count(plan, rank), "values": values}


def _regular_count(plan: SavePlan, rank: int) -> int:
    """How many of ``rank``'s own objects are regular ones (they come first)."""
    return len(plan.own(rank)) - len(plan.for_rank(rank)) if plan.regular is not None else 0


def _collect_markers(
    store: Store, step: int, plan: SavePlan, reports: Reports, timeout_s: float
) -> None:
    """Rank 0: take every other rank's report from its done marker into ``reports``; raises a
    reported error, or TimeoutError."""
    waiting = set(range(1, len(reports.counts)))
    for _ in _poll(timeout_s):
        listing = store.listdir(step_dir(step)) if waiting else {}
        for name in sorted(listing):
            m = _DONE.match(name)
            if m is None or m.group(1) != plan.attempt or int(m.group(2)) not in waiting:
                continue
            rank = int(m.group(2))
            marker = json.loads(
                store.read_bounded(done_marker(step, plan.attempt, rank), MAX_MANIFEST_BYTES)
            )
            if marker["error"]:
                raise CheckpointError(f"rank {rank} failed to write step {step}: {marker['error']}")
            reports.take(rank, marker)
            waiting.discard(rank)
        if not waiting:
            return
    raise TimeoutError(
        f"step {step} at {store.where()}: ranks {sorted(waiting)} did not finish writing within "
        f"{timeout_s}s"
    )


class Reports:
    """Rank 0's tally of the other ranks' reports (``report_of``, a done marker's content), each
    checked against the plan as it is taken, and the manifest they make with rank 0's own."""

    def __init__(
        self, plan: SavePlan, step: int, world: int, crcs: Crcs, values: dict[str, Any]
    ) -> None:
        self.plan, self.step, self.crcs = plan, step, dict(crcs)
        self.sizes: dict[str, int] = {}  # regular objects as their ranks report them
        self.counts = [0] * world  # regular objects per rank
        self.values: list[dict[str, Any]] = [values] + [{} for _ in range(world - 1)]

    def take(self, rank: int, marker: dict[str, Any]) -> None:
        """Take rank ``rank``'s report; CheckpointError when it disagrees with the plan."""
        for obj in self.plan.for_rank(rank):
            got = marker["objects"].get(obj.name, {})
            if got.get("size") != obj.size or got.get("checksums") is None:
                raise CheckpointError(
                    f"rank {rank} reported {got.get('size')} bytes for {obj.name}, "
                    f"the plan says {obj.size}"
                )
            self.crcs[obj.name] = got["checksums"]
        if not isinstance(marker.get("values"), dict):
            raise CheckpointError(f"rank {rank}'s report of step {self.step} has no values")
        self.values[rank] = marker["values"]
        if self.plan.regular is None:
            return
        count = marker.get("regular")
        if type(count) is not int or count < 0:
            raise CheckpointError(
                f"rank {rank}'s done marker of step {self.step} has no regular count"
            )
        for i in range(count):
            name = object_name(rank, i, self.plan.attempt)
            got = marker["objects"].get(name, {})
            if type(got.get("size")) is not int or not isinstance(got.get("checksums"), list):
                raise CheckpointError(f"rank {rank} did not report its regular object {name}")
            self.crcs[name], self.sizes[name] = got["checksums"], got["size"]
        self.counts[rank] = count

    def manifest(self, checksum_block_bytes: int) -> Manifest:
        """The manifest, once every other rank's report is taken (rank 0's regular objects are
        added here)."""
        plan, regular = self.plan, None
        if plan.regular is not None:
            self.counts[0] = _regular_count(plan, 0)
            self.sizes.update((o.name, o.size) for o in plan.own(0)[: self.counts[0]])
            regular = (self.counts, self.sizes)
        return build_manifest(
            plan,
            self.crcs,
            step=self.step,
            world_size=len(self.counts),
            checksum_block_bytes=checksum_block_bytes,
            values=self.values[0],
            rank_values=self.values,
            regular=regular,
        )


def _poll(timeout: float) -> Iterator[None]:
    """Yield until ``timeout`` seconds have passed, sleeping a little longer each time."""
    deadline, delay = time.monotonic() + timeout, 0.005
    while True:
        yield
        if time.monotonic() > deadline:
            return
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
