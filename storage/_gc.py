"""``collect_garbage``: what retention and torn attempts leave behind, removed or only listed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftsdp.storage._errors import CheckpointNotFoundError
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import parse_step
from ftsdp.storage._steps import committed_steps, retain


class _RecordingStore(Store):
    """A store whose removals are recorded instead of performed (the dry run of ``retain``)."""

    removed: list[tuple[str, bool]]

    def remove(self, rel: str, recursive: bool = False) -> None:
        self.removed.append((rel, recursive))


@dataclass
class GcReport:
    """Steps and files that were (or, in a dry run, would be) removed, and the bytes they hold."""

    url: str
    dry_run: bool
    removed_steps: list[int] = field(
        default_factory=list
    )  # committed steps past retention, torn ones
    removed_paths: list[str] = field(default_factory=list)  # every removal, in order
    kept_steps: list[int] = field(default_factory=list)
    in_progress: list[int] = field(default_factory=list)  # torn but newer than the newest commit
    bytes: int = 0


def collect_garbage(
    url: str,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> GcReport:
    """Remove torn attempts and the steps retention would remove (``keep_last`` newest committed
    steps and every ``keep_every``-th; default: keep every committed step). Exactly what
    ``apply_retention`` removes, computed by running it against a recording store first. Torn
    steps newer than the newest committed one may be a save in progress and are kept."""
    store = Store(url, storage_options)
    if not store.exists():
        raise CheckpointNotFoundError(f"checkpoint root {store.where()} does not exist")
    committed = committed_steps(store)
    recorder = object.__new__(_RecordingStore)
    recorder.__dict__.update(store.__dict__, removed=[])
    steps = retain(recorder, keep_last or len(committed), keep_every) if committed else []
    report = GcReport(store.where(), dry_run, removed_steps=steps)
    newest = committed[-1] if committed else -1
    report.in_progress = sorted(
        s
        for s in map(parse_step, store.listdir())
        if s is not None and s > newest and s not in committed
    )
    report.kept_steps = [s for s in committed if s not in steps]
    seen = set()
    for rel, _ in recorder.removed:
        if rel in seen or not store.exists(rel):
            continue
        seen.add(rel)
        report.removed_paths.append(store.where(rel))
        if not rel.endswith("manifest.json") or rel.count("/") != 1:
            report.bytes += store.disk_usage(rel)
    if not dry_run:
        for rel, recursive in recorder.removed:
            store.remove(rel, recursive=recursive)
    return report
