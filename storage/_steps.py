"""Committed steps: listing, resolving and reading a manifest, and retention / garbage collection."""

from __future__ import annotations

import warnings
from typing import Any

from ftsdp.storage._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import MANIFEST, manifest_path, parse_step, step_dir
from ftsdp.storage._manifest import Manifest


def committed_steps(store: Store) -> list[int]:
    """Steps whose manifest exists, ascending (one listing of the root plus one per step dir)."""
    steps = []
    for name, (kind, _) in store.listdir().items():
        step = parse_step(name)
        if step is not None and kind == "directory" and store.exists(manifest_path(step)):
            steps.append(step)
    return sorted(steps)


def list_steps(url: str, *, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Committed steps under ``url``, ascending; ``[]`` when the root does not exist (yet)."""
    return committed_steps(Store(url, storage_options))


def resolve_manifest(store: Store, step: int | None) -> Manifest:
    """The validated manifest of ``step`` (None: the newest committed), its objects checked.

    Raises CheckpointNotFoundError (no root, nothing committed, step not committed),
    NewerFormatError, CorruptCheckpointError, or IncompleteCheckpointError (an object listed by
    the manifest is missing or has another size).
    """
    if step is None:
        steps = committed_steps(store)
        if not steps:
            if not store.exists():
                raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
            torn = sorted(s for s in map(parse_step, store.listdir()) if s is not None)
            raise CheckpointNotFoundError(
                f"no committed step under {store.where()} (uncommitted step dirs: {torn}); "
                "a step is committed once its manifest.json exists"
            )
        step = steps[-1]
    elif not store.exists(manifest_path(step)):
        if not store.exists():
            raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
        raise CheckpointNotFoundError(
            f"step {step} is not committed under {store.where()} (no {manifest_path(step)}); "
            f"committed steps: {committed_steps(store)}"
        )
    where = store.where(manifest_path(step))
    manifest = Manifest.from_json(store.read(manifest_path(step)), where=where)
    if manifest.step != step:
        raise CorruptCheckpointError(f"{where}: manifest says step {manifest.step}")
    listing = store.listdir(step_dir(step))
    for name, size in sorted(manifest.objects.items()):
        if name not in listing:
            raise IncompleteCheckpointError(
                f"step {step}: object {store.where(f'{step_dir(step)}/{name}')} listed in the "
                "manifest is missing; the checkpoint is incomplete, load another step"
            )
        if listing[name][1] != size:
            raise IncompleteCheckpointError(
                f"step {step}: object {store.where(f'{step_dir(step)}/{name}')} has "
                f"{listing[name][1]} bytes, the manifest lists {size}"
            )
    return manifest


def remove_step(store: Store, step: int) -> None:
    """Delete a step: the manifest first, so a crash midway leaves a torn step, never a bad one."""
    store.remove(manifest_path(step))
    store.remove(step_dir(step), recursive=True)


def retain(store: Store, keep_last: int, keep_every: int | None) -> list[int]:
    """Apply retention under ``store``; return the removed steps (committed and torn), ascending."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1 (the newest step is always kept)")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every={keep_every} must be >= 1 or None")
    committed = committed_steps(store)
    if not committed:
        return []
    newest = committed[-1]
    keep = set(committed[-keep_last:])
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    removed = []
    for name in store.listdir():
        step = parse_step(name)
        if step is None or step in keep:
            continue
        # Uncommitted dirs newer than the newest committed step may be a save in progress.
        if step in committed or step < newest:
            remove_step(store, step)
            removed.append(step)
    for step in keep:
        _remove_strays(store, step)
    return sorted(removed)


def _remove_strays(store: Store, step: int) -> None:
    """Delete files of torn attempts inside a committed step (names its manifest does not list)."""
    try:
        manifest = resolve_manifest(store, step)
    except Exception as e:  # a damaged step is reported by load, not deleted by retention
        warnings.warn(f"retention: cannot read step {step}: {e}", stacklevel=3)
        return
    for name in store.listdir(step_dir(step)):
        if name != MANIFEST and name not in manifest.objects:
            store.remove(f"{step_dir(step)}/{name}", recursive=True)


def apply_retention(
    url: str,
    *,
    keep_last: int,
    keep_every: int | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` committed steps and every step divisible by ``keep_every``.

    Never removes the newest committed step or an uncommitted step newer than it (a save in
    progress); removes older uncommitted (torn) step dirs and stray files of torn attempts inside
    kept steps. Returns the removed steps.
    """
    return retain(Store(url, storage_options), keep_last, keep_every)


def read_manifest(
    url: str, step: int | None = None, *, storage_options: dict[str, Any] | None = None
) -> Manifest:
    """The validated manifest of a committed step (None: the newest), its objects checked."""
    return resolve_manifest(Store(url, storage_options), step)
