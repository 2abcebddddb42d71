"""Committed steps: listing, resolving and reading a manifest; which step directories are ours, and
deleting them (retention, garbage collection, discarding an abandoned timeline)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ftsdp.storage._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ftsdp.storage._options import LoadOptions
from ftsdp.storage.format._layout import (
    LATEST,
    MANIFEST,
    attempt_of,
    is_own_name,
    manifest_path,
    parse_step,
    step_dir,
)
from ftsdp.storage.format._manifest import Manifest, read_manifest_file
from ftsdp.storage.io._fs import Store

logger = logging.getLogger(__name__)
# What ``gc`` and ``apply_retention`` take for a save that may still be running: a step directory
# whose uncommitted files were written less than this long ago (a job that resumed from an older
# step saves below the newest committed one).
GRACE_S = 3600.0
VANISHED = "manifest.json vanished"  # while it was read: someone else is removing the step


def committed_steps(store: Store) -> list[int]:
    """Steps whose manifest exists, ascending (one listing of the root plus one per step dir)."""
    steps = []
    for name, (kind, _) in store.listdir().items():
        step = parse_step(name)
        if step is not None and kind == "directory" and store.exists(manifest_path(step)):
            steps.append(step)
    return sorted(steps)


def _newest_committed(store: Store) -> tuple[int, dict[str, tuple[str, int]]] | None:
    """The newest committed step and its directory's listing, or None (step directories listed
    newest first until one holds a manifest)."""
    names = store.listdir().items()
    dirs = sorted(
        (s for n, (k, _) in names if k == "directory" and (s := parse_step(n)) is not None)
    )
    for step in reversed(dirs):
        if MANIFEST in (listing := store.listdir(step_dir(step))):
            return step, listing
    return None


def list_steps(url: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Committed steps under ``url``, ascending; ``[]`` when the root does not exist (yet)."""
    return committed_steps(Store(url, storage_options))


def resolve_manifest(
    store: Store, step: int | None, options: LoadOptions | None = None
) -> Manifest:
    """The validated manifest of ``step`` (None: the newest committed), its objects checked.
    Raises CheckpointNotFoundError, NewerFormatError, CorruptCheckpointError, or
    IncompleteCheckpointError (a listed object missing or of another size)."""
    # One listing of the step directory answers whether it is committed, the manifest's size
    # (capped before it is read) and the objects' sizes: taken with the manifest present, it
    # lists every object (a commit creates the manifest last).
    if step is None:
        newest = _newest_committed(store)
        if newest is None:
            if not store.exists():
                raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
            torn = sorted(s for s in map(parse_step, store.listdir()) if s is not None)
            raise CheckpointNotFoundError(
                f"no committed step under {store.where()} (uncommitted step dirs: {torn}); "
                "a step is committed once its manifest.json exists"
            )
        step, listing = newest
    elif MANIFEST not in (listing := store.listdir(step_dir(step))):
        if not store.exists():
            raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
        raise CheckpointNotFoundError(
            f"step {step} is not committed under {store.where()} (no {manifest_path(step)}); "
            f"committed steps: {committed_steps(store)}"
        )
    where = store.where(manifest_path(step))
    kind, size = listing[MANIFEST]  # not a file: read_manifest_file says so
    manifest = read_manifest_file(
        store, manifest_path(step), options, size=size if kind == "file" else None
    )  # size-capped, validated
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: manifest says step {manifest.step}")
    bad = object_problem(manifest, listing)
    if bad is not None:
        name, why = bad
        where = store.where(f"{step_dir(step)}/{name}")
        raise IncompleteCheckpointError(
            f"step {step}: object {where} listed in the manifest is missing; the checkpoint is "
            "incomplete, load another step"
            if why is None
            else f"step {step}: object {where} {why}"
        )
    return manifest


def object_problem(
    manifest: Manifest, listing: dict[str, tuple[str, int]]
) -> tuple[str, str | None] | None:
    """The first object of ``manifest`` that its step directory's ``listing`` lacks (``(name,
    None)``) or holds at another size (``(name, "has N bytes, the manifest lists M")``); None
    when every one is there whole."""
    for name, size in sorted(manifest.objects.items()):
        if name not in listing:
            return name, None
        if listing[name][1] != size:
            return name, f"has {listing[name][1]} bytes, the manifest lists {size}"
    return None


# -- what is ours: scanning a root, deleting steps ------------------------------------------------
# [Note: deleting only what is ours] (docs/format.md, "Retention and garbage collection"): every
# deletion rests on content (a validated manifest of its own step, this format's names), never
# recursive, never through a link.


@dataclass
class StepDir:
    """One ``step-<N>`` directory (no link) as a scan found it."""

    step: int
    entries: dict[str, tuple[str, int]]  # its listing: name -> (type, size)
    manifest: Manifest | None = None  # validated and of this step: the step is committed
    problem: str | None = None  # why its manifest.json is not a committed step of this format
    listed: bool = True  # False: a step of ``Known``, its directory not listed (``entries`` {})

    @property
    def has_manifest(self) -> bool:
        return MANIFEST in self.entries or not self.listed


@dataclass
class Known:
    """What the saves of one process to one root learned of it: the manifests of the steps they
    committed or read there, so that later saves neither list those step directories again nor
    read their manifests (on S3 each is a request). A committed manifest does not change while
    its step exists; a step that left the root's listing, or that retention or a discard
    removed, is forgotten. Owned by whoever saves (``saving``'s lane of the root)."""

    manifests: dict[int, Manifest] = field(default_factory=dict)
    told: set[str] = field(default_factory=set)  # what retention left alone, logged once


@dataclass
class RootScan:
    """The ``step-<N>`` entries of a root: directories, and what was skipped (and why)."""

    dirs: dict[int, StepDir] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def committed(self) -> list[int]:
        return sorted(s for s, d in self.dirs.items() if d.manifest is not None)

    @property
    def with_manifest(self) -> list[int]:
        """Steps whose manifest exists, valid or not (what readers list)."""
        return sorted(s for s, d in self.dirs.items() if d.has_manifest)


def scan_root(
    store: Store, read: Callable[[int], bool] = lambda step: True, known: Known | None = None
) -> RootScan:
    """List the step directories under ``store`` and validate the manifests of the steps ``read``
    selects; links are skipped, never followed. The steps of ``known`` are taken from it
    unlisted (``StepDir.listed`` False); the manifests read are added to it."""
    scan = RootScan()
    try:
        listing = store.listdir()
    except NotADirectoryError:  # the root is a file: it holds no steps (writing there fails)
        listing = {}
    for name, (kind, _) in sorted(listing.items()):
        step = parse_step(name)
        if step is None:
            continue
        if store.is_link(name):
            scan.skipped.append(f"{store.where(name)}: a link; never followed")
        elif name != step_dir(step):  # step-007: no name this format writes
            scan.skipped.append(f"{store.where(name)}: not a step name of this format")
        elif kind != "directory":
            scan.skipped.append(f"{store.where(name)}: not a directory")
        elif known is not None and step in known.manifests:
            scan.dirs[step] = StepDir(step, {}, known.manifests[step], listed=False)
        else:
            d = scan.dirs[step] = StepDir(step, store.listdir(step_dir(step)))
            if d.has_manifest and read(step):
                d.manifest, d.problem = own_manifest(store, step)
            if known is not None and d.manifest is not None:
                known.manifests[step] = d.manifest
    if known is not None:
        for step in set(known.manifests) - set(scan.dirs):  # gone from the root
            del known.manifests[step]
    return scan


def own_manifest(store: Store, step: int) -> tuple[Manifest | None, str | None]:
    """``(manifest, None)`` when ``step``'s manifest is a valid manifest of this format for this
    step, else ``(None, why not)``."""
    rel = manifest_path(step)
    if store.is_link(rel) or not store.inside_root(rel):
        return None, "manifest.json is a link"
    try:
        manifest = read_manifest_file(store, rel)
    except FileNotFoundError:
        return None, VANISHED
    except Exception as e:  # whatever the bytes: not ours
        return None, f"{type(e).__name__}: {e}"
    if manifest.step != step:
        return None, f"its manifest says step {manifest.step}"
    return manifest, None


@dataclass
class Deletion:
    """The files of one step directory to delete, in order, and the names that are not ours."""

    step: int
    files: list[tuple[str, int]] = field(default_factory=list)  # (path under the root, size)
    left: list[str] = field(default_factory=list)
    whole: bool = True  # the step goes: its directory is removed once empty

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)


def _mine(store: Store, d: StepDir, name: str, listed: Collection[str] = ()) -> bool:
    """Whether ``name`` in ``d`` is ours (or listed), no link, and inside the root."""
    rel = f"{step_dir(d.step)}/{name}"
    kind = d.entries[name][0]
    return (
        (name in listed or is_own_name(name))
        and kind != "directory"
        and not store.is_link(rel)
        and store.inside_root(rel)
    )


def plan_removal(store: Store, d: StepDir) -> Deletion | None:
    """What deleting step ``d`` removes (manifest first); None when the step must stay (an
    unreadable manifest, or a torn dir holding files not ours)."""
    if d.problem is not None:
        return None
    listed = d.manifest.objects if d.manifest is not None else {}
    names = sorted(d.entries, key=lambda n: (n != MANIFEST, n not in listed, n))
    plan = _sort_out(store, d, Deletion(d.step), names, listed)
    if d.manifest is None and plan.left:
        return None  # a torn directory holding things that are not ours: not ours to clean
    return plan


def _sort_out(
    store: Store, d: StepDir, plan: Deletion, names: list[str], listed: Collection[str] = ()
) -> Deletion:
    """``plan`` with each of ``names`` in ``d`` added to its files when ours, else to ``left``."""
    for name in names:
        if _mine(store, d, name, listed):
            plan.files.append((f"{step_dir(d.step)}/{name}", d.entries[name][1]))
        else:
            plan.left.append(name)
    return plan


def execute(store: Store, plan: Deletion, done: list[str] | None = None) -> None:
    """Delete the files of ``plan`` in order (each checked again), then its directory if the
    step goes and nothing is left in it; each path removed is appended to ``done``."""
    for rel, _ in plan.files:
        if not store.is_link(rel) and store.inside_root(rel):
            store.remove(rel)
            if done is not None:
                done.append(rel)
    if plan.whole and not plan.left:
        store.remove_empty_dir(step_dir(plan.step))


def remove_step(store: Store, step: int, *, attempt: str | None = None) -> list[str]:
    """Delete step ``step`` if it is ours, and only what it owns; with ``attempt``, only a
    committed step of that attempt. Returns what stays, and why."""
    if store.is_link(step_dir(step)):
        return [f"{store.where(step_dir(step))}: a link; never followed"]
    d = StepDir(step, store.listdir(step_dir(step)))
    if d.has_manifest:
        d.manifest, d.problem = own_manifest(store, step)
    if attempt is not None and (d.manifest is None or d.manifest.attempt != attempt):
        return [f"{store.where(step_dir(step))}: left alone, no longer attempt {attempt}'s commit"]
    plan = plan_removal(store, d)
    if plan is None:
        return [_why_left(store, d)]
    execute(store, plan)
    return [_foreign(store, step, n) for n in plan.left]


def remove_attempt(store: Store, step: int, attempt: str) -> None:
    """Delete the objects and markers of one save attempt in step ``step`` (never the manifest)."""
    d = StepDir(step, store.listdir(step_dir(step)))
    for name in sorted(d.entries):
        if attempt_of(name) == attempt and _mine(store, d, name):
            store.remove(f"{step_dir(step)}/{name}")


def _why_left(store: Store, d: StepDir) -> str:
    where = store.where(step_dir(d.step))
    if d.problem == VANISHED:
        return f"{where}: removed by someone else meanwhile ({VANISHED} while it was read)"
    if d.problem is not None:
        return (
            f"{where}: left alone, its manifest.json is not a committed step of this format "
            f"({d.problem})"
        )
    others = [n for n in sorted(d.entries) if not _mine(store, d, n)]
    shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
    return f"{where}: left alone, no manifest and it holds files not of this format ({shown})"


def _foreign(store: Store, step: int, name: str) -> str:
    return f"{store.where(f'{step_dir(step)}/{name}')}: not written by this format, left"


@dataclass
class RetentionPlan:
    """What retention (or ``gc``) deletes and keeps under a root."""

    removals: list[Deletion] = field(default_factory=list)  # whole steps: past retention, torn
    strays: list[Deletion] = field(default_factory=list)  # garbage inside kept steps
    kept: list[int] = field(default_factory=list)  # committed steps kept
    in_progress: list[int] = field(default_factory=list)  # torn, newer than the newest commit
    notes: list[str] = field(default_factory=list)  # left alone, and why
    vanished: list[int] = field(default_factory=list)  # being removed by someone else meanwhile

    @property
    def removed_steps(self) -> list[int]:
        return sorted(p.step for p in self.removals)


def plan_retention(
    store: Store,
    keep_last: int | None,
    keep_every: int | None,
    protect: int | None = None,
    scan: RootScan | None = None,
    known: Known | None = None,
    grace_s: float | None = None,
) -> RetentionPlan:
    """What retention removes (docs/format.md, "Retention and garbage collection", damaged steps
    and ``grace_s`` included); ``protect`` is always kept. ``scan``: a fresh ``scan_root`` that
    read every manifest (else one is taken, with ``known``). A kept step of ``known`` is neither
    listed nor read; one that goes is listed and read again. Callers refuse ``keep_last < 1``."""
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every={keep_every} must be >= 1 or None")
    if grace_s is not None and not (math.isfinite(grace_s) and grace_s >= 0):
        raise ValueError(f"grace_s={grace_s} must be a number of seconds >= 0")
    scan = scan_root(store, known=known) if scan is None else scan
    plan = RetentionPlan(notes=list(scan.skipped))
    committed = scan.committed
    damaged = {s: why for s in committed if (why := _damage(scan.dirs[s]))}
    complete = [s for s in committed if s not in damaged]
    keep = set(committed if keep_last is None else complete[-keep_last:])
    keep |= {s for s in complete if keep_every and s % keep_every == 0}
    for s, why in damaged.items():
        if not complete or s > complete[-1]:  # a newer step than every loadable one: evidence
            keep.add(s)
            plan.notes.append(f"{store.where(step_dir(s))}: kept, but not counted ({why})")
    if protect is not None and protect in committed:
        keep.add(protect)
    newest = committed[-1] if committed else None
    since = None if not grace_s else time.time() - grace_s
    for step, d in sorted(scan.dirs.items()):
        if step in keep:
            if d.listed and d.manifest is not None:  # strays: our names it does not list
                names = sorted(set(d.entries) - {MANIFEST, *d.manifest.objects})
                strays = _sort_out(store, d, Deletion(step, whole=False), names)
                if strays.files and _written_since(store, strays, since):
                    plan.notes.append(
                        f"{store.where(step_dir(step))}: files it does not list were written less "
                        f"than {grace_s:g} s ago, left for now (a save may be writing them)"
                    )
                    continue
                plan.strays.append(strays)
                plan.notes += [_foreign(store, step, n) for n in strays.left]
            continue
        if not d.listed:  # a known step that goes: as it is now (a deletion rests on content)
            d = StepDir(step, store.listdir(step_dir(step)))
            if d.has_manifest:
                d.manifest, d.problem = own_manifest(store, step)
        if d.manifest is None and not d.has_manifest and (newest is None or step > newest):
            plan.in_progress.append(step)  # a save may be writing it
            continue
        if d.problem == VANISHED:  # another gc or a job's retention is removing it
            plan.vanished.append(step)
            continue
        removal = plan_removal(store, d)
        if removal is None:
            plan.notes.append(_why_left(store, d))
            continue
        if d.manifest is None and _written_since(store, removal, since):
            plan.in_progress.append(step)  # torn and written lately: a save may be writing it
            continue
        plan.removals.append(removal)
        plan.notes += [_foreign(store, step, n) for n in removal.left]
    plan.kept = sorted(keep)
    return plan


def _damage(d: StepDir) -> str | None:
    """Why committed step ``d`` cannot load by its listing, or None (a step of ``Known``, not
    listed, was whole when this process saw it)."""
    assert d.manifest is not None
    bad = object_problem(d.manifest, d.entries) if d.listed else None
    if bad is None:
        return None
    return f"its object {bad[0]} {bad[1] or 'is missing'}"


def _written_since(store: Store, plan: Deletion, since: float | None) -> bool:
    """Whether a file of ``plan`` was written after ``since`` (None: never asked); a file that
    vanished meanwhile counts (something is at work there)."""
    if since is None:
        return False
    for rel, _ in plan.files:
        try:
            if store.modified(rel) > since:
                return True
        except FileNotFoundError:
            return True
    return False


def retain(
    store: Store,
    keep_last: int,
    keep_every: int | None,
    protect: int | None = None,
    scan: RootScan | None = None,
    known: Known | None = None,
    grace_s: float | None = None,
) -> list[int]:
    """Apply retention under ``store`` (``plan_retention``); the removed steps, ascending (and
    forgotten by ``known``). What was left alone is logged as a WARNING (once for ``known``'s
    saves)."""
    if keep_last is None or keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (the newest step is always kept)")
    plan = plan_retention(store, keep_last, keep_every, protect, scan, known, grace_s)
    for removal in plan.removals + plan.strays:
        if known is not None and removal.whole:
            known.manifests.pop(removal.step, None)
        execute(store, removal)
    notes = plan.notes if known is None else [n for n in plan.notes if n not in known.told]
    if notes:  # (the saves of one process to a root say each once: not at every save)
        logger.warning("retention left alone: %s", "; ".join(notes))
        if known is not None:
            known.told.update(notes)
    return plan.removed_steps


def apply_retention(
    url: str,
    *,
    keep_last: int,
    keep_every: int | None = None,
    grace_s: float = GRACE_S,
    storage_options: dict[str, Any] | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` committed steps and every step divisible by ``keep_every``,
    deleting only what is provably ours and nothing uncommitted written less than ``grace_s``
    seconds ago (a save may be writing it); returns the removed steps."""
    return retain(Store(url, storage_options), keep_last, keep_every, grace_s=grace_s)


def read_manifest(
    url: str, step: int | None = None, *, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """The validated manifest of a committed step (None: the newest), its objects checked."""
    return resolve_manifest(Store(url, storage_options), step)


def clear_steps(url: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Delete every step under ``url`` that is provably ours, committed or torn, then ``latest``
    and the root itself when nothing else is left (a cache of a run, such as the memory tier);
    returns the removed steps."""
    store = Store(url, storage_options)
    scan = scan_root(store)
    removed = []
    for step in sorted(scan.dirs, reverse=True):
        left = remove_step(store, step)
        if not left:
            removed.append(step)
        else:
            logger.warning("clearing %s left alone: %s", store.where(), "; ".join(left))
    if not scan.skipped and not [s for s in scan.dirs if s not in removed]:
        with contextlib.suppress(FileNotFoundError):
            if store.listdir().keys() <= {LATEST} and not store.is_link(LATEST):
                store.remove(LATEST)
        store.remove_empty_dir("")
    return sorted(removed)
