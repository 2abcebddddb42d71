"""Looking at checkpoints without loading them, streaming: ``inspect_checkpoint``, ``verify``
(every problem found, not only the first), ``diff``."""

from __future__ import annotations

import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch

from ftsdp.storage._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
)
from ftsdp.storage.conversion._formats import detect_format, open_source
from ftsdp.storage.conversion._interfaces import Source
from ftsdp.storage.format._checksum import checksum_function
from ftsdp.storage.format._dtypes import safetensors_code, torch_dtype
from ftsdp.storage.format._layout import MANIFEST, manifest_path, parse_step, step_dir
from ftsdp.storage.format._manifest import Manifest, Piece, TensorEntry, read_manifest_file
from ftsdp.storage.format._safetensors import read_header
from ftsdp.storage.format._steps import committed_steps, resolve_manifest
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._streaming import (
    DEFAULT_MAX_MEMORY,
    Meter,
    Progress,
    chunk_bytes,
    split_request,
)

_THREADED_BYTES = 16 << 20  # a step's data below this is checked on the calling thread
_MAPPED_PART = 32 << 20  # the bytes of a local object one thread maps and checks at a time
OBJECT_METADATA = {"format": "ftsdp.storage"}  # every data object's header (docs/format.md)
_FORMAT_MARK = b'"ftsdp.storage"'  # a manifest's first 64 bytes hold its format (as written)
REMOVED = "removed while checking (retention or gc)"  # a step that went while verify or diff ran


def _step_dirs(store: Store) -> tuple[list[int], list[int]]:
    """(committed, torn) steps under a root."""
    committed = committed_steps(store)
    torn = sorted(
        s for s in map(parse_step, store.listdir()) if s is not None and s not in committed
    )
    return committed, torn


def _step_directory(
    url: str, step: int | None, storage_options: dict | None
) -> tuple[str, int | None]:
    """``(root, N)`` for a step directory ``ROOT/step-N``, else ``(url, step)``."""
    store = Store(url, storage_options)
    if not store.isdir() or MANIFEST not in store.listdir():
        return url, step
    parent, _, name = store.url.rpartition("/")
    own = parse_step(name)
    if own is None or parent.endswith(":/") or (not parent and "://" in store.url):
        size = store.size(MANIFEST)
        if _FORMAT_MARK not in store.read_range(MANIFEST, 0, min(size, 64)):
            return url, step  # someone else's manifest.json: detect the format as usual
        raise ValueError(
            f"{url} holds a step's {MANIFEST} but is not a step-<N> directory of a checkpoint "
            "root; pass the checkpoint root (and --step)"
        )
    if step is not None and step != own:
        raise ValueError(f"{url} is the directory of step {own}, but step {step} was asked for")
    return parent or ("/" if store.url.startswith("/") else "."), own


def tensor_layout(entry: TensorEntry) -> dict[str, Any]:
    """How an ftsdp tensor is laid out (JSON): with a grid, its cuts per dim (``grid``) and the
    number of cells per dim (``cells``); with a layout rule, ``rule`` (``{"kind": "even",
    "start", "chunk"}`` or ``{"kind": "writer", "writer"}``), else ``pieces``: how many it lists."""
    out: dict[str, Any] = {}
    if entry.grid is not None:
        out["grid"] = [list(c) for c in entry.grid]
        out["cells"] = [max(len(c) - 1, 1) for c in entry.grid]
    if entry.rule is not None:
        kind, *args = entry.rule.as_json()
        names = {"even": ("start", "chunk"), "writer": ("writer",)}.get(kind, ())
        out["rule"] = {"kind": kind, **dict(zip(names, args, strict=True))}
    else:
        out["pieces"] = len(entry.explicit)
    return out


def inspect_checkpoint(
    url: str,
    step: int | None = None,
    *,
    storage_options: dict | None = None,
    trust_pickle: bool = False,
) -> dict[str, Any]:
    """A JSON-able description: format, steps (committed and torn), world size, tensors with
    shape, dtype and bytes (and, for ftsdp, ``layout``: see ``tensor_layout``), totals and the non-tensor state's keys. Reads metadata only. A step
    directory (``ROOT/step-N``) is that step of its root."""
    url, step = _step_directory(url, step, storage_options)
    fmt = detect_format(url, storage_options)
    info: dict[str, Any] = {"url": url, "format": fmt}
    if fmt == "ftsdp":
        committed, torn = _step_dirs(Store(url, storage_options))
        info.update(committed_steps=committed, torn_steps=torn)
        if not committed:
            info.update(step=None, tensors=[], total_tensors=0, total_bytes=0, values=[])
            return info
    with closing(open_source(url, fmt, step, storage_options, trust_pickle=trust_pickle)) as source:
        tensors: list[dict[str, Any]] = [
            {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "bytes": t.nbytes,
            }
            for t in sorted(source.tensors.values(), key=lambda t: t.name)
        ]
        manifest = getattr(source, "manifest", None)  # ftsdp: each tensor's saved layout
        if isinstance(manifest, Manifest):
            for t in tensors:
                t["layout"] = tensor_layout(manifest.tensors[t["name"]])
        info.update(
            step=source.step,
            world_size=source.world_size,
            tensors=tensors,
            total_tensors=len(tensors),
            total_bytes=sum(t["bytes"] for t in tensors),
            values=sorted(source.values),
            dropped=source.dropped_list(),
        )
        return info


@dataclass
class VerifyReport:
    """Problems found, per step checked (ftsdp) or under ``None`` (other formats)."""

    url: str
    format: str
    checked: list[int | None] = field(default_factory=list)
    torn_steps: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bytes_read: int = 0
    removed: list[int] = field(default_factory=list)  # steps removed while checked: no problem

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_header(
    store: Store, step: int, name: str, pieces: list[tuple[str, str, Piece]], problems: list[str]
) -> bool:
    """Check an object's header against its manifest pieces; False when it cannot be read."""
    rel = f"{step_dir(step)}/{name}"
    url = store.where(rel)
    try:
        header, base = read_header(store, rel)
    except FileNotFoundError:  # removed after the listing (CheckpointNotFoundError too)
        problems.append(f"step {step}: object {url} is missing")
        return False
    except CheckpointError as e:
        problems.append(f"step {step}: {e}")
        return False
    except (TypeError, ValueError, AttributeError, KeyError) as e:  # a header read_header misreads
        problems.append(f"step {step}: object {url}: malformed safetensors header ({e})")
        return False
    if header.get("__metadata__") != OBJECT_METADATA:
        problems.append(
            f"step {step}: object {url}: safetensors __metadata__ is "
            f"{str(header.get('__metadata__'))[:200]}, not {OBJECT_METADATA}"
        )
    for tname, dtype, p in pieces:
        entry = header.get(p.key)
        if not isinstance(entry, dict) or [
            base + o if type(o) is int else None for o in entry.get("data_offsets", ())
        ] != [p.byte_start, p.byte_end]:
            problems.append(
                f"step {step}: object {url}: piece {p.key!r} of tensor {tname} is not where the "
                "manifest says"
            )
            continue
        code = safetensors_code(torch_dtype(dtype))
        if entry.get("dtype") != code or entry.get("shape") != [p.length]:
            problems.append(
                f"step {step}: object {url}: piece {p.key!r} of tensor {tname} is "
                f"{entry.get('dtype')!r} of shape {entry.get('shape')!r} in the object, but "
                f"{code!r} of shape {[p.length]} ({dtype}) in the manifest"
            )
    return True


def _verify_step(
    store: Store,
    step: int,
    manifest: Manifest | CheckpointError,
    chunk: int,
    meter: Meter,
    problems: list[str],
) -> None:
    if isinstance(manifest, CheckpointError):
        msg = str(manifest)  # a derivation error names the step already
        problems.append(msg if msg.startswith(f"step {step}:") else f"step {step}: {msg}")
        return
    if manifest.step != step:
        problems.append(
            f"step {step}: {store.where(manifest_path(step))} says step {manifest.step}: it "
            "belongs to another step (loaders refuse it)"
        )
    listing = store.listdir(step_dir(step))
    block = manifest.checksum_block_bytes
    check = checksum_function(manifest.checksum_algorithm)
    by_object: dict[str, list[tuple[str, str, Piece]]] = {n: [] for n in manifest.objects}
    for tname, t in manifest.tensors.items():
        for p in t.pieces:
            by_object[p.object].append((tname, t.dtype, p))
    bad_objects = set()
    for name, size in sorted(manifest.objects.items()):
        url = store.where(f"{step_dir(step)}/{name}")
        if name not in listing:
            problems.append(f"step {step}: object {url} is missing")
        elif listing[name][0] == "directory":
            problems.append(f"step {step}: object {url} is a directory, not a file")
        elif listing[name][1] != size:
            problems.append(
                f"step {step}: object {url} has {listing[name][1]} bytes, the manifest lists {size}"
            )
        elif _check_header(store, step, name, by_object[name], problems):
            continue
        bad_objects.add(name)
    # Parts are checked on threads (the checksum releases the GIL): a local object on its mapped
    # pages, a thread per CPU; a remote one read into a buffer per thread, ``chunk`` in flight.
    if store.local:
        threads = min(store.io.threads, _cpus())
        per = max(block, _MAPPED_PART // block * block)
    else:
        threads = max(1, store.io.threads)
        per = max(block, chunk // threads // block * block)
    parts = [
        (tname, p, f"{step_dir(step)}/{p.object}", start, min(start + per, p.byte_end))
        for tname, t in sorted(manifest.tensors.items())
        for p in t.pieces
        if p.object not in bad_objects
        for start in range(p.byte_start, p.byte_end, per)
    ]

    buffers = threading.local()  # one reused buffer per thread: no allocation per part
    missing: set[str] = set()  # objects removed while their parts were read

    def part_bytes(rel: str, start: int, end: int) -> memoryview:
        if store.local:
            return store.map_range(rel, start, end).data
        if not hasattr(buffers, "buf"):
            buffers.buf = bytearray(per)
        mv = memoryview(buffers.buf)[: end - start]
        store.read_into(rel, start, mv)
        return mv

    def check_part(part: tuple[str, Piece, str, int, int]) -> tuple[int, list[str]]:
        tname, p, rel, start, end = part
        found = []
        try:
            view = part_bytes(rel, start, end)
        except FileNotFoundError:  # removed after the listing: said once, below
            missing.add(rel)
            return end - start, []
        with view as mv:
            for k0 in range(0, end - start, block):
                k = (start - p.byte_start + k0) // block
                if check(mv[k0 : k0 + block], 0) != p.checksums[k]:
                    a = start + k0
                    found.append(
                        f"step {step}: tensor {tname}: checksum mismatch in {store.where(rel)} "
                        f"bytes [{a}, {min(a + block, p.byte_end)})"
                    )
        return end - start, found

    small = sum(end - start for *_, start, end in parts) < _THREADED_BYTES  # not worth threads
    with ThreadPoolExecutor(max(1, min(threads, len(parts)))) as pool:
        for nbytes, found in (map if small else pool.map)(check_part, parts):
            meter.add(nbytes)
            problems.extend(found)
    problems.extend(f"step {step}: object {store.where(rel)} is missing" for rel in sorted(missing))


def _cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or ``taskset``'s share)."""
    if hasattr(os, "sched_getaffinity"):  # not on macOS, Windows
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _verify_source(source: Source, chunk: int, meter: Meter, problems: list[str]) -> None:
    for name, info in sorted(source.tensors.items()):
        try:
            for r in split_request(name, 0, info.numel, info.itemsize, chunk):
                out = torch.empty(r.length, dtype=info.dtype)
                source.read_into([(name, r.offset, out)])
                meter.add(out.numel() * info.itemsize)
        except (CheckpointError, OSError, ValueError, RuntimeError) as e:
            problems.append(f"tensor {name}: {e}")


def verify(
    url: str,
    step: int | None = None,
    *,
    max_memory: int = DEFAULT_MAX_MEMORY,
    storage_options: dict | None = None,
    progress: Progress | None = None,
    trust_pickle: bool = False,
) -> VerifyReport:
    """Read every byte of a checkpoint and report each problem (missing or short objects, bad
    manifests, a manifest of another step, pieces misplaced or of another dtype than their
    object's header says, checksum mismatches). For ftsdp, every committed step is checked (or
    only ``step``); torn steps are listed, not counted as problems, and so are the steps removed
    (manifest gone) while checked (``removed``; CheckpointNotFoundError for ``step``). A step
    directory (``ROOT/step-N``) is checked as step N of its root."""
    chunk = chunk_bytes(max_memory)
    given = url
    url, step = _step_directory(url, step, storage_options)
    fmt = detect_format(url, storage_options)
    report = VerifyReport(given, fmt)
    if fmt != "ftsdp":
        # open_source refuses a step for a format without steps
        source = open_source(url, fmt, step, storage_options, chunk, trust_pickle=trust_pickle)
        with closing(source):
            meter = Meter(sum(t.nbytes for t in source.tensors.values()), progress)
            report.checked = [None]
            _verify_source(source, chunk, meter, report.problems)
            report.problems.extend(f"{d}: not checked" for d in source.dropped_list())
        report.bytes_read = meter.done
        return report
    store = Store(url, storage_options)
    committed, report.torn_steps = _step_dirs(store)
    if step is not None and step not in committed:
        resolve_manifest(store, step)  # raises the right CheckpointNotFoundError
    checked = [step] if step is not None else committed
    report.checked = [*checked]
    if not checked:
        report.problems.append(f"no committed step under {url} (torn steps: {report.torn_steps})")
        return report
    manifests: dict[int, Manifest | CheckpointError | None] = {}  # None: removed meanwhile
    total = 0
    for s in checked:  # read and parsed once: for the total, then for the checks
        try:
            m = read_manifest_file(store, manifest_path(s))
            # a version 4 manifest's rule pieces are derived here: their errors are this step's
            total += sum(p.byte_end - p.byte_start for t in m.tensors.values() for p in t.pieces)
            manifests[s] = m
        except FileNotFoundError:  # (CheckpointNotFoundError too) removed since the listing
            manifests[s] = None
        except CheckpointError as e:
            manifests[s] = e
    meter = Meter(total, progress)
    for s, manifest in manifests.items():
        # Retention or gc may remove a step while it is checked (its manifest first): what is
        # missing of a step whose manifest is gone is that removal, not a problem.
        found: list[str] = []
        try:
            if manifest is not None:
                _verify_step(store, s, manifest, chunk, meter, found)
        except FileNotFoundError as e:  # a file of the step vanished where none was expected
            found.append(f"step {s}: {e.filename or e} vanished while it was read")
        if manifest is None or (found and not store.exists(manifest_path(s))):
            report.removed.append(s)
        else:
            report.problems += found
    if step is not None and report.removed:
        raise CheckpointNotFoundError(f"step {step}: {REMOVED}")
    report.checked = [s for s in checked if s not in report.removed]
    report.bytes_read = meter.done
    return report


def _compare(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(elements that differ, max abs difference) of two equal-length 1-D chunks."""
    if a.dtype == torch.bool or b.dtype == torch.bool:
        ne = a.to(torch.int8) != b.to(torch.int8)
        return int(ne.sum()), float(ne.any())
    if not (a.is_floating_point() or a.is_complex() or b.is_floating_point() or b.is_complex()):
        # integers exactly (float64 holds them only up to 2**53); the difference in float64
        ne = a.to(torch.int64) != b.to(torch.int64)
        if not bool(ne.any()):
            return 0, 0.0
        d = (a[ne].to(torch.float64) - b[ne].to(torch.float64)).abs()
        return int(ne.sum()), max(float(d.max()), 1.0)  # they differ by 1 at least
    a64 = a.to(torch.complex128 if a.is_complex() else torch.float64)
    b64 = b.to(a64.dtype)
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    if bool(same.all()):
        return 0, 0.0
    # NaN against a number differs by inf; +inf stays inf (nan_to_num's default makes it the
    # largest double)
    d = torch.where(same, 0.0, (a64 - b64).abs()).nan_to_num(nan=math.inf, posinf=math.inf)
    return int((~same).sum()), float(d.max())


def _same_value(x: Any, y: Any) -> bool:
    """Two JSON values are the same as JSON: NaN is NaN, and 1, 1.0 and True differ."""
    return json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True)


def diff(
    url_a: str,
    step_a: int | None,
    url_b: str,
    step_b: int | None,
    *,
    max_memory: int = DEFAULT_MAX_MEMORY,
    storage_options: dict | None = None,
    progress: Progress | None = None,
    trust_pickle: bool = False,
) -> dict[str, Any]:
    """Compare two checkpoints (two steps of one root, or any two) tensor by tensor, streaming.

    Returns ``{"tensors": [{"name", "status", "changed", "max_abs_diff"}...], "values": [...]}``
    where status is ``same``, ``changed``, ``only_a``, ``only_b`` or ``shape`` (not compared);
    a dtype change is compared in float64 and flagged ``dtype``.
    """
    chunk = chunk_bytes(max_memory) // 4  # two chunks and their float64 copies in flight

    def opened(url: str, step: int | None) -> closing[Source]:
        return closing(
            open_source(url, None, step, storage_options, chunk, trust_pickle=trust_pickle)
        )

    with opened(url_a, step_a) as a, opened(url_b, step_b) as b:
        common = sorted(set(a.tensors) & set(b.tensors))
        rows: list[dict[str, Any]] = []
        rows += [{"name": n, "status": "only_a"} for n in sorted(set(a.tensors) - set(b.tensors))]
        rows += [{"name": n, "status": "only_b"} for n in sorted(set(b.tensors) - set(a.tensors))]
        meter = Meter(sum(a.tensors[n].nbytes + b.tensors[n].nbytes for n in common), progress)
        for n in common:
            ta, tb = a.tensors[n], b.tensors[n]
            if ta.shape != tb.shape:
                rows.append(
                    {"name": n, "status": "shape", "a": list(ta.shape), "b": list(tb.shape)}
                )
                continue
            changed, worst = 0, 0.0
            for r in split_request(n, 0, ta.numel, 8, chunk):
                xa = torch.empty(r.length, dtype=ta.dtype)
                xb = torch.empty(r.length, dtype=tb.dtype)
                _read_step(a, n, r.offset, xa)
                _read_step(b, n, r.offset, xb)
                meter.add(r.length * (ta.itemsize + tb.itemsize))
                c, w = _compare(xa, xb)
                changed, worst = changed + c, max(worst, w)
            status = "dtype" if ta.dtype != tb.dtype else ("changed" if changed else "same")
            rows.append(
                {
                    "name": n,
                    "status": status,
                    "changed": changed,
                    "numel": ta.numel,
                    "max_abs_diff": worst,
                }
            )
        rows.sort(key=lambda r: r["name"])
        values = [
            {"name": k, "a": a.values.get(k), "b": b.values.get(k)}
            for k in sorted(set(a.values) | set(b.values))
            if (k in a.values) != (k in b.values) or not _same_value(a.values[k], b.values[k])
        ]
        return {
            "a": {"url": url_a, "step": a.step},
            "b": {"url": url_b, "step": b.step},
            "tensors": rows,
            "values": values,
        }


def _read_step(source: Source, name: str, offset: int, out: torch.Tensor) -> None:
    """``source.read_into`` for one request; an object of an ftsdp step that is gone (the
    reader's IncompleteCheckpointError) is that step's removal (retention or gc, which remove
    its manifest first) while its manifest is gone too: said in one line."""
    try:
        source.read_into([(name, offset, out)])
    except IncompleteCheckpointError:
        step = source.step if source.format == "ftsdp" else None
        if step is not None and not source.store.exists(manifest_path(step)):
            raise CheckpointNotFoundError(f"step {step}: {REMOVED}") from None
        raise
