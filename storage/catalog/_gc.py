"""``collect_garbage``: exactly what retention would delete (``plan_retention``, [Note: deleting
only what is ours]) and torn attempts, removed or only listed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftsdp.storage._errors import CheckpointNotFoundError
from ftsdp.storage.format._layout import step_dir
from ftsdp.storage.format._steps import execute, plan_retention
from ftsdp.storage.io._fs import Store


@dataclass
class GcReport:
    """Steps and files that were (or, in a dry run, would be) removed, and the bytes they hold."""

    url: str
    dry_run: bool
    # committed steps past retention, torn ones
    removed_steps: list[int] = field(default_factory=list)
    removed_paths: list[str] = field(default_factory=list)  # every removal, in order
    kept_steps: list[int] = field(default_factory=list)
    in_progress: list[int] = field(default_factory=list)  # torn but newer than the newest commit
    bytes: int = 0
    left_alone: list[str] = field(default_factory=list)  # not provably ours: untouched, and why
    # steps whose manifest vanished while gc read it: another gc or a job's retention removes them
    removed_elsewhere: list[int] = field(default_factory=list)


def collect_garbage(
    url: str,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> GcReport:
    """Remove torn attempts and the steps retention would remove (``keep_last`` newest committed
    steps and every ``keep_every``-th; ``keep_last=None``: keep every committed step, and
    ``keep_last < 1`` is a ValueError). Exactly what ``apply_retention`` removes. Torn steps
    newer than the newest committed one may be a save in progress and are kept."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(
            f"keep_last={keep_last} must be >= 1 (the newest committed step is always kept); "
            "leave it out to keep every committed step"
        )
    store = Store(url, storage_options)
    if not store.exists():
        raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
    plan = plan_retention(store, keep_last, keep_every)
    report = GcReport(
        store.where(),
        dry_run,
        removed_steps=plan.removed_steps,
        kept_steps=plan.kept,
        in_progress=plan.in_progress,
        left_alone=plan.notes,
        removed_elsewhere=plan.vanished,
    )
    removals = plan.removals + plan.strays
    for removal in removals:
        report.removed_paths += [store.where(rel) for rel, _ in removal.files]
        if removal.whole and not removal.left:
            report.removed_paths.append(store.where(step_dir(removal.step)))
        report.bytes += removal.bytes
    if not dry_run:
        for removal in removals:
            execute(store, removal)
    return report
