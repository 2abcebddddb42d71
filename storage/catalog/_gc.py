"""``collect_garbage``: exactly what retention would delete (``plan_retention``, [Note: deleting
only what is ours]) and torn attempts, removed or only listed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ftsdp.storage._errors import CheckpointNotFoundError
from ftsdp.storage.format._layout import MANIFEST, parse_step, step_dir
from ftsdp.storage.format._steps import GRACE_S, execute, plan_retention
from ftsdp.storage.io._fs import Store

logger = logging.getLogger(__name__)


@dataclass
class GcReport:
    """Steps and files that were (or, in a dry run, would be) removed, and the bytes they hold."""

    url: str
    dry_run: bool
    # committed steps past retention, torn ones
    removed_steps: list[int] = field(default_factory=list)
    removed_paths: list[str] = field(default_factory=list)  # every removal, in order
    kept_steps: list[int] = field(default_factory=list)
    # torn, but newer than the newest commit or written within the grace period
    in_progress: list[int] = field(default_factory=list)
    bytes: int = 0
    left_alone: list[str] = field(default_factory=list)  # not provably ours: untouched, and why
    failed: list[str] = field(default_factory=list)  # removals that raised, and what they said
    # steps whose manifest vanished while gc read it: another gc or a job's retention removes them
    removed_elsewhere: list[int] = field(default_factory=list)


def collect_garbage(
    url: str,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    dry_run: bool = False,
    grace_s: float = GRACE_S,
    storage_options: dict[str, Any] | None = None,
) -> GcReport:
    """Remove torn attempts and the steps retention would remove (``keep_last`` newest committed
    steps and every ``keep_every``-th; ``keep_last=None``: keep every committed step, and
    ``keep_last < 1`` is a ValueError). Exactly what ``apply_retention`` removes. Torn steps
    newer than the newest committed one, and uncommitted files written less than ``grace_s``
    seconds ago, may be a save in progress and are kept. A removal that fails is reported in
    ``GcReport.failed`` and the others go on."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(
            f"keep_last={keep_last} must be >= 1 (the newest committed step is always kept); "
            "leave it out to keep every committed step"
        )
    store = Store(url, storage_options)
    check_root(store)
    plan = plan_retention(store, keep_last, keep_every, grace_s=grace_s)
    report = GcReport(
        store.where(),
        dry_run,
        kept_steps=plan.kept,
        in_progress=plan.in_progress,
        left_alone=plan.notes,
        removed_elsewhere=plan.vanished,
    )
    for removal in plan.removals + plan.strays:
        done: list[str] = []
        try:
            if not dry_run:
                execute(store, removal, done)
        except OSError as e:
            report.failed.append(f"{store.where(step_dir(removal.step))}: {e}")
        else:
            done = [rel for rel, _ in removal.files]
            if removal.whole:  # its manifest went: the step is gone, foreign files or not
                report.removed_steps.append(removal.step)
                if not removal.left:
                    done.append(step_dir(removal.step))
        report.removed_paths += [store.where(rel) for rel in done]
        gone = set(done)
        report.bytes += sum(size for rel, size in removal.files if rel in gone)
    report.removed_steps.sort()
    if report.failed:
        logger.warning(
            "gc of %s: %d removals failed: %s", report.url, len(report.failed), report.failed
        )
    return report


def check_root(store: Store) -> None:
    """Refuse what cannot be a checkpoint root: nothing there, a file, or a step directory
    (whose parent is the root)."""
    if not store.exists():
        raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
    if store.isfile():
        raise CheckpointNotFoundError(f"{store.where()} is a file, not a checkpoint root")
    if parse_step(store.root.rpartition("/")[2]) is not None and MANIFEST in store.listdir():
        raise CheckpointNotFoundError(
            f"{store.where()} is a step directory; its checkpoint root is the folder above"
        )
