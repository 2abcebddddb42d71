"""``load`` (in place, any world size -> any world size) and ``load_state_dict`` (one process)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftsdp.storage import _errors
from ftsdp.storage._errors import CheckpointError, StateMismatchError
from ftsdp.storage._options import LoadOptions
from ftsdp.storage.format._dtypes import dtype_name, itemsize
from ftsdp.storage.format._layout import manifest_path
from ftsdp.storage.format._manifest import Manifest
from ftsdp.storage.format._state import TensorLeaf, flatten_state
from ftsdp.storage.format._steps import resolve_manifest
from ftsdp.storage.io._collectives import all_gather_json, broadcast_json, rank_world, resolve_group
from ftsdp.storage.io._fs import Store
from ftsdp.storage.loading._read_plan import Want, make_want, plan_reads
from ftsdp.storage.loading._reader import Delivery, fetch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` did on this rank."""

    step: int
    saved_world_size: int
    missing: list[str] = field(default_factory=list)  # in the target, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the target
    mismatched: list[str] = field(default_factory=list)  # shape/dtype/kind differs: not loaded
    bytes_read: int = 0
    bytes_needed: int = 0
    values: dict[str, Any] = field(default_factory=dict)  # non-tensor values restored


_ERRORS = {
    cls.__name__: cls
    for cls in (
        _errors.CheckpointNotFoundError,
        _errors.IncompleteCheckpointError,
        _errors.CorruptCheckpointError,
        _errors.NewerFormatError,
        FileNotFoundError,
        ValueError,
    )
}


def _shared_manifest(
    store: Store, step: int | None, group: ProcessGroup | None, options: LoadOptions
) -> Manifest:
    """Rank 0 resolves and validates the manifest; every rank gets it (or the same error)."""
    rank, _ = rank_world(group)
    msg: dict[str, Any] = {}
    manifest = None
    if rank == 0:
        try:
            manifest = resolve_manifest(store, step, options)
            msg = {"manifest": manifest.to_json().decode()}
        except Exception as e:
            if group is None:
                raise
            msg = {"error": [type(e).__name__, str(e)]}
    msg = broadcast_json(msg, group)
    if "error" in msg:
        raise _ERRORS.get(msg["error"][0], CheckpointError)(msg["error"][1])
    if manifest is None:
        # (the newest step: the one rank 0 found, named inside the manifest)
        where = store.where(manifest_path(step)) if step is not None else store.where()
        manifest = Manifest.from_json(
            msg["manifest"].encode(),
            where=where,
            max_bytes=options.max_manifest_bytes,
            max_depth=options.max_json_depth,
        )
    return manifest


def _match(
    manifest: Manifest, tensors: dict[str, TensorLeaf], values: dict, rank: int, cast: bool
) -> tuple[list[Want], list[TensorLeaf], dict[str, Any], LoadResult]:
    saved_values = dict(manifest.values)
    if rank < len(manifest.rank_values):
        saved_values.update(manifest.rank_values[rank])
    missing: list[str] = []
    mismatched: list[str] = []
    wants: list[Want] = []
    targets: list[TensorLeaf] = []
    for name, leaf in sorted(tensors.items()):
        entry = manifest.tensors.get(name)
        if entry is None:
            (mismatched if name in saved_values else missing).append(name)
        elif entry.shape != leaf.shape:
            mismatched.append(
                f"{name} (saved shape {list(entry.shape)}, target {list(leaf.shape)})"
            )
        elif leaf.local.device.type == "meta":
            mismatched.append(
                f"{name} (target on the meta device, which holds no values: make it real first, "
                "e.g. module.to_empty(device=...), or use load_into)"
            )
        elif entry.dtype != dtype_name(leaf.dtype) and not cast:
            mismatched.append(
                f"{name} (saved dtype {entry.dtype}, target {dtype_name(leaf.dtype)}; "
                "pass cast=True to convert)"
            )
        else:
            wants.append(make_want(name, entry, leaf.range, leaf.box))
            targets.append(leaf)
    restored = {}
    for name in sorted(values):
        if name in saved_values:
            restored[name] = saved_values[name]
        else:
            (mismatched if name in manifest.tensors else missing).append(name)
    unexpected = sorted(
        n for n in (*manifest.tensors, *saved_values) if n not in tensors and n not in values
    )
    result = LoadResult(
        step=manifest.step,
        saved_world_size=manifest.world_size,
        missing=missing,
        unexpected=unexpected,
        mismatched=mismatched,
        bytes_needed=sum(w.numel * itemsize(w.staging.dtype) for w in wants),
        values=restored,
    )
    return wants, targets, restored, result


def load(
    state: Mapping[str, Any],
    url: str,
    step: int | None = None,
    *,
    process_group: ProcessGroup | None = None,
    strict: bool = True,
    cast: bool = False,
    storage_options: dict[str, Any] | None = None,
    options: LoadOptions | None = None,
) -> LoadResult:
    """Fill ``state`` in place from step ``step`` (None: newest committed) saved at any world size.

    Each rank reads only the byte ranges its tensors need. Missing / unexpected keys and shape or
    dtype mismatches raise ``StateMismatchError`` naming them (``strict=False``: reported in the
    result, mismatched entries skipped); dtypes convert only with ``cast=True``. Everything is
    read and verified before anything is written, and all ranks agree first: a failed load
    leaves the target untouched on every rank (unless a rank reads more than
    ``options.inflight_bytes`` from an object store: see ``LoadOptions``). Collective over
    ``process_group``.
    """
    options = options or LoadOptions()
    group = resolve_group(process_group)
    rank, _ = rank_world(group)
    store = Store(url, storage_options, options.io)
    manifest = _shared_manifest(store, step, group, options)

    error: Exception | None = None
    stream = False
    try:
        tensors, values = flatten_state(state)
        wants, targets, restored, result = _match(manifest, tensors, values, rank, cast)
        problems = result.missing + result.unexpected + result.mismatched
        if strict and problems:
            raise StateMismatchError(
                f"step {manifest.step} at {store.where()} does not match the target state on rank "
                f"{rank}: missing={result.missing} unexpected={result.unexpected} "
                f"mismatched={result.mismatched} (strict=False loads the rest and reports these)"
            )
        spans = plan_reads(wants, manifest.checksum_block_bytes, options.coalesce_gap_bytes)
        delivery = Delivery(wants, [leaf.local for leaf in targets])
        budget = options.inflight_bytes
        stream = (
            budget is not None and not store.local and sum(s.end - s.start for s in spans) > budget
        )
        if stream:
            log.info(
                "loading step %d from %s: more than inflight_bytes=%d to read on rank %d, so "
                "each verified part goes into the target as it arrives",
                *(manifest.step, store.where(), budget, rank),
            )
        place = delivery.place if stream else None
        segments, bytes_read = fetch(store, manifest, spans, place, budget or 0)
    except Exception as e:
        error = e
    if group is not None:
        report = None if error is None else f"{type(error).__name__}: {error}"
        reports = all_gather_json(report, group)
        failed = [r for r, rep in enumerate(reports) if rep is not None]
        if error is None and failed:
            raise CheckpointError(
                f"load of step {manifest.step} failed on rank(s) {failed} "
                f"({reports[failed[0]]}); "
                + ("this rank's target is partly loaded" if stream else "nothing was loaded")
            )
    if error is not None:
        raise error

    delivery.finish(segments, options.io.threads)
    for name, value in restored.items():
        leaf = values[name]
        leaf.parent[leaf.key] = value
    return LoadResult(**{**result.__dict__, "bytes_read": bytes_read})
