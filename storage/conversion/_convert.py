"""``convert`` and ``reshard``: any supported format to any other, streamed under a memory budget.

Options and overlapping locations are refused before anything is opened, and the source is opened
before the destination is touched (docs/cli.md, "Threat model")."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from ftsdp.storage._options import IOOptions
from ftsdp.storage.conversion._formats import SinkOptions, get_format, open_source
from ftsdp.storage.conversion._interfaces import Feed, OutTensor, Source
from ftsdp.storage.conversion._mesh import (
    MAX_MESH_RANKS,
    PlacementRules,
    check_mesh,
    parse_placements,
)
from ftsdp.storage.conversion._sinks import PENDING
from ftsdp.storage.format._layout import HF_INDEX, HF_SHARD, HF_SINGLE
from ftsdp.storage.io._fs import Store, is_plain_name
from ftsdp.storage.io._streaming import DEFAULT_MAX_MEMORY, Meter, Progress, TensorInfo, chunk_bytes

# First components of names that hold optimizer state (dropped by ``model_only``).
OPTIMIZER_ROOTS = frozenset((
    "optim", "optimizer", "optimizers", "opt",
    "optim_state", "optimizer_state", "optim_state_dict", "optimizer_state_dict",
))  # fmt: skip


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote."""

    source_format: str
    dest_format: str
    step: int | None  # the step written (ftsdp destinations)
    world_size: int | None  # the layout written (ftsdp destinations)
    tensors: int
    bytes_read: int
    written: list[str] = field(default_factory=list)  # URLs of what was written
    dropped: list[str] = field(default_factory=list)  # source entries that could not be carried
    extra: list[str] = field(default_factory=list)  # names of the extra and copied files written
    source_step: int | None = None  # the step read (sources that have steps: ftsdp)
    mesh: tuple[int, ...] | None = None  # the mesh laid out on (ftsdp destinations with a mesh)


def check_locations(src: str, dst: str, storage_options: dict[str, Any] | None) -> None:
    """ValueError when ``src`` and ``dst`` are one place or either lies inside the other, however
    spelled (``file://``, relative paths, symlinks, ``s3``/``s3a``: see ``Store.location``)."""
    a, b = Store(src, storage_options), Store(dst, storage_options)
    if a.contains(b) and b.contains(a):
        raise ValueError(f"source and destination are the same location ({src}); write elsewhere")
    if a.contains(b) or b.contains(a):
        pair = (f"destination {dst}", f"source {src}")
        inner, outer = pair if a.contains(b) else pair[::-1]
        raise ValueError(
            f"the {inner} lies inside the {outer} (same location underneath); write elsewhere"
        )


def _check_extra_names(dst: str, to: str, names: Sequence[str]) -> None:
    """ValueError for extra file names an hf folder destination cannot take."""
    if not names:
        return
    if to != "hf" or dst.rstrip("/").endswith(".safetensors"):
        raise ValueError(
            f"extra files {sorted(names)} go into an hf folder destination only (--to hf, a "
            f"directory), not {dst} as {to}"
        )
    for name in names:
        if not is_plain_name(name):
            raise ValueError(f"extra file name {name!r} must be one plain file name (no path)")
        if name in (HF_INDEX, HF_SINGLE, PENDING) or HF_SHARD.fullmatch(name):
            raise ValueError(f"extra file name {name!r} is a name the hf checkpoint itself uses")
    if len(set(names)) != len(names):
        raise ValueError(f"extra file names {sorted(names)} name a file twice")


def _extra_writers(
    extra_files: Mapping[str, bytes],
    copy_files: Sequence[str],
    copy_files_from: str | None,
    storage_options: dict[str, Any] | None,
    chunk: int,
) -> list[tuple[str, Callable[[IO[bytes]], None]]]:
    """(name, produce) of each extra file, then of each of ``copy_files`` found."""
    out: list[tuple[str, Callable[[IO[bytes]], None]]] = []
    for name, data in extra_files.items():
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"extra file {name!r}: expected bytes, got {type(data).__name__}")

        def given(f: IO[bytes], data: bytes = bytes(data)) -> None:
            f.write(data)

        out.append((name, given))
    if not copy_files or copy_files_from is None:
        return out
    src = Store(copy_files_from, storage_options)
    if not src.isdir():
        return out
    listing = src.listdir()
    for name in copy_files:
        if name not in listing or not src.isfile(name):
            continue

        def produce(f: IO[bytes], name: str = name) -> None:
            size = src.size(name)
            for start in range(0, size, chunk):
                f.write(src.read_range(name, start, min(start + chunk, size)))

        out.append((name, produce))
    return out


# First components of the other names a training checkpoint holds beside the model's and the
# optimizer's (CheckpointManager's RNG states, trainer and scheduler values).
TRAINING_ROOTS = frozenset(("trainer", "rng", "scheduler"))


def training_layout(fmt: str, names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor ``names`` are a training checkpoint's: the model under
    ``model.``, every other tensor under an optimizer root or the manager's own. A Hugging Face
    folder never is, nor a model's own state dict whose names start with ``model.`` beside
    others (a Llama's ``model.layers.0...`` and ``lm_head.weight``)."""
    if fmt == "hf":
        return False
    names = list(names)
    allowed = {"model", *OPTIMIZER_ROOTS, *TRAINING_ROOTS}
    return any(n.startswith("model.") for n in names) and all(
        n.split(".", 1)[0] in allowed for n in names
    )


def _is_model_state(name: str, has_model_root: bool) -> bool:
    if has_model_root:
        return name.startswith("model.")
    return name.split(".", 1)[0] not in OPTIMIZER_ROOTS


def select(
    source: Source,
    *,
    model_only: bool,
    rename: Sequence[tuple[str, str]],
    dtype: torch.dtype | None,
    strip_prefix: str | None = None,
    exclude: Collection[str] = (),
) -> tuple[list[OutTensor], dict[str, Any]]:
    """Output tensors (renamed, cast) and values for a source; ValueError when names collide.

    ``model_only`` keeps the names under ``model.`` of a training checkpoint
    (``training_layout``), else drops those under an ``OPTIMIZER_ROOTS`` name, and drops all
    values. ``rename`` maps prefixes (first match wins), then ``strip_prefix`` is stripped; the
    tensors named in ``exclude`` are left out."""
    exclude = frozenset(exclude)
    rules = [*rename, (strip_prefix, "")] if strip_prefix else list(rename)

    def renamed(name: str) -> str:
        for old, new in rules:
            if name.startswith(old):
                if name == old and not new:
                    raise ValueError(f"renaming {name!r} leaves an empty name")
                return new + name[len(old) :]
        return name

    has_model_root = training_layout(source.format, source.tensors)
    outputs: dict[str, OutTensor] = {}
    for name, info in sorted(source.tensors.items()):
        if name in exclude or (model_only and not _is_model_state(name, has_model_root)):
            continue
        out = renamed(name)
        if out in outputs:
            raise ValueError(
                f"tensors {outputs[out].source_name!r} and {name!r} both become {out!r}"
            )
        cast = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
        outputs[out] = OutTensor(TensorInfo(out, info.shape, cast), name)
    values: dict[str, Any] = {}
    names: dict[str, str] = {}  # output value name -> its source name
    for name, value in [] if model_only else sorted(source.values.items()):
        out = renamed(name)
        if out in names:
            raise ValueError(f"values {names[out]!r} and {name!r} both become {out!r}")
        names[out], values[out] = name, value
    clash = sorted(set(values) & set(outputs))
    if clash:
        raise ValueError(f"names {clash} are both tensors and values after renaming")
    return list(outputs.values()), values


def convert(
    src: str,
    dst: str,
    *,
    to: str,
    src_format: str | None = None,
    step: int | None = None,
    dtype: torch.dtype | None = None,
    model_only: bool = False,
    rename: Sequence[tuple[str, str]] = (),
    world_size: int | None = None,
    max_shard_bytes: int | None = None,
    dst_step: int | None = None,
    overwrite: bool = False,
    max_memory: int = DEFAULT_MAX_MEMORY,
    object_bytes: int = 256 << 20,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    trust_pickle: bool = False,
    strip_prefix: str | None = None,
    exclude: Collection[str] = (),
    extra_files: Mapping[str, bytes] | None = None,
    copy_files: Sequence[str] = (),
    copy_files_from: str | None = None,
    mesh: Sequence[int] | None = None,
    placements: PlacementRules = (),
) -> ConvertResult:
    """Convert the checkpoint at ``src`` (format detected unless ``src_format``) to ``to`` at ``dst``.

    ``step`` picks an ftsdp source step (newest by default), ``dst_step`` the step written (default:
    the source's, else 0). ``dtype`` casts floating tensors; ``world_size`` lays an ftsdp output out
    in even flat ranges, ``mesh`` (dim sizes) as its ranks would hold DTensors of the placements
    that the ``placements`` rules give (``(fnmatch pattern, "S0,R")``, first match wins; default:
    mesh dim ``m`` shards tensor dim ``m``; see ``_mesh.py``); ``max_shard_bytes`` splits hf output;
    ``model_only``, ``rename``, ``strip_prefix`` and ``exclude``: see ``select``. Memory in flight
    stays within ``max_memory``; ``progress(done, total)`` is told the bytes read; ``trust_pickle``:
    see ``open_source``. Into an hf folder only, before its commit file: ``extra_files`` (plain name
    -> bytes), and the ``copy_files`` found in the directory ``copy_files_from`` (docs/cli.md).

    Raises ``FileExistsError`` when ``dst`` holds a checkpoint unless ``overwrite`` (which removes
    only that checkpoint), ``ValueError`` for invalid options or overlapping locations."""
    extra_files = dict(extra_files or {})
    get_format(to)  # ValueError for an unknown format
    if world_size is not None and (to != "ftsdp" or world_size < 1):
        raise ValueError(
            f"world_size={world_size} conflicts with --to {to}: only the ftsdp format has a world "
            "size (>= 1)"
        )
    if world_size is not None and world_size > MAX_MESH_RANKS:
        raise ValueError(f"world_size={world_size} is more than {MAX_MESH_RANKS} ranks")
    if mesh is not None:
        mesh = check_mesh(mesh)
        if to != "ftsdp" or world_size not in (None, math.prod(mesh)):
            raise ValueError(
                f"mesh={list(mesh)} conflicts with --to {to} and world_size={world_size}: only "
                "the ftsdp format is laid out on a mesh, of as many ranks as it has"
            )
        for _, spec in placements:
            parse_placements(spec, len(mesh))  # ValueError before anything is opened
    elif placements:
        raise ValueError("placements apply to a mesh layout only: pass mesh (--mesh) too")
    if max_shard_bytes is not None and (to != "hf" or max_shard_bytes < 1):
        raise ValueError(
            f"max_shard_bytes={max_shard_bytes} conflicts with --to {to}: only hf output is sharded by size"
        )
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating dtype (only floating tensors are cast)")
    for old, new in rename:
        if not old:
            raise ValueError(f"rename {old!r}={new!r}: the old prefix must not be empty")
    if strip_prefix is not None and not strip_prefix:
        raise ValueError("strip_prefix='' strips nothing; pass None or a prefix such as 'model.'")
    _check_extra_names(dst, to, [*extra_files, *copy_files])
    check_locations(src, dst, storage_options)
    chunk = chunk_bytes(max_memory)
    source = open_source(src, src_format, step, storage_options, chunk, trust_pickle=trust_pickle)
    with closing(source):
        outputs, values = select(
            source, model_only=model_only, rename=rename, dtype=dtype,
            strip_prefix=strip_prefix, exclude=exclude,
        )  # fmt: skip
        extra = _extra_writers(extra_files, copy_files, copy_files_from, storage_options, chunk)
        store = Store(dst, storage_options, IOOptions(part_bytes=chunk))  # uploads buffer a chunk
        options = SinkOptions(
            world_size, max_shard_bytes, object_bytes, overwrite, tuple(extra),
            tuple(mesh) if mesh is not None else None, tuple(placements),
        )  # fmt: skip
        sink = get_format(to).sink(store, options)
        if sink.holds_checkpoint():
            if not overwrite:
                raise FileExistsError(
                    f"{dst} already holds a {to} checkpoint; pass overwrite (--overwrite) to replace it"
                )
            sink.clear()
        meter = Meter(sum(source.tensors[o.source_name].nbytes for o in outputs), progress)
        feed = Feed(source, outputs, chunk, meter)
        if hasattr(source, "order"):  # sources that read whole items prefetch in write order
            source.order = sorted(o.source_name for o in outputs)
        out_step = dst_step if dst_step is not None else (source.step or 0)
        rank_values = source.rank_values if not model_only else []
        written = sink.write(feed, values, rank_values, out_step)
        steps = get_format(to).steps
        return ConvertResult(
            source_format=source.format,
            dest_format=to,
            step=out_step if steps else None,
            world_size=(math.prod(mesh) if mesh else world_size or 1) if steps else None,
            tensors=len(outputs),
            bytes_read=meter.done,
            written=written,
            dropped=source.dropped_list(),
            extra=[name for name, _ in extra],
            source_step=source.step,
            mesh=tuple(mesh) if mesh is not None and steps else None,
        )


def reshard(
    src: str,
    dst: str,
    world_size: int | None = None,
    *,
    step: int | None = None,
    mesh: Sequence[int] | None = None,
    placements: PlacementRules = (),
    **kwargs: Any,
) -> ConvertResult:
    """Rewrite a checkpoint as an ftsdp checkpoint laid out for ``world_size`` ranks, offline, each
    tensor split into even flat ranges as a sharded save would; or, with ``mesh`` (its dim sizes,
    e.g. ``(2, 2)`` for dp x tp), as the ranks of that mesh save DTensors of the ``placements`` that
    rules give: the boxes of a grid, format version 5 (other arguments: ``convert``)."""
    if mesh is None and (not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"world_size={world_size!r} must be an int >= 1 (or pass a mesh)")
    return convert(
        src, dst, to="ftsdp", step=step, world_size=world_size, mesh=mesh,
        placements=placements, **kwargs,
    )  # fmt: skip
