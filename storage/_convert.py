"""``convert`` and ``reshard``: any supported format to any other, streamed under a memory budget.

Options are checked before anything is opened, the source is opened (and validated) before the
destination is touched, and the destination is cleared (``overwrite``) commit-file first, so a
failure at any point leaves either the old destination, nothing that looks complete, or the new
one. The source and the destination must not overlap, however their URLs spell them (see
``Store.location``): the same place, or either inside the other, is refused before anything is
opened, so a conversion can never clear or overwrite its own source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ftsdp.storage._formats import FORMATS, has_steps, make_sink, open_source
from ftsdp.storage._fs import Store
from ftsdp.storage._interfaces import Feed, OutTensor, Source
from ftsdp.storage._streaming import DEFAULT_MAX_MEMORY, Meter, Progress, TensorInfo, chunk_bytes

# First components of names that hold optimizer state (dropped by ``model_only``).
OPTIMIZER_ROOTS = frozenset(
    {
        "optim",
        "optimizer",
        "optimizers",
        "opt",
        "optim_state",
        "optimizer_state",
        "optim_state_dict",
        "optimizer_state_dict",
    }
)


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


def check_locations(src: str, dst: str, storage_options: dict[str, Any] | None) -> None:
    """ValueError when ``src`` and ``dst`` are one place or either lies inside the other, however
    spelled (``file://``, relative paths, symlinks, ``s3``/``s3a``: see ``Store.location``)."""
    a, b = Store(src, storage_options), Store(dst, storage_options)
    if a.contains(b) and b.contains(a):
        raise ValueError(f"source and destination are the same location ({src}); write elsewhere")
    if a.contains(b):
        raise ValueError(
            f"the destination {dst} lies inside the source {src} (same location underneath); "
            "write elsewhere"
        )
    if b.contains(a):
        raise ValueError(
            f"the source {src} lies inside the destination {dst} (same location underneath); "
            "write elsewhere"
        )


def check_options(
    src: str,
    dst: str,
    to: str,
    *,
    dtype: torch.dtype | None,
    rename: Sequence[tuple[str, str]],
    world_size: int | None,
    max_shard_bytes: int | None,
    max_memory: int,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """ValueError for conflicting or invalid options, or overlapping locations; returns the chunk
    size of the budget."""
    if to not in FORMATS:
        raise ValueError(f"unknown format {to!r}; choose one of {', '.join(FORMATS)}")
    if world_size is not None and (to != "ftsdp" or world_size < 1):
        raise ValueError(
            f"world_size={world_size} conflicts with --to {to}: only the ftsdp format has a world "
            "size (>= 1)"
        )
    if max_shard_bytes is not None and (to != "hf" or max_shard_bytes < 1):
        raise ValueError(
            f"max_shard_bytes={max_shard_bytes} conflicts with --to {to}: only hf output is sharded by size"
        )
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating dtype (only floating tensors are cast)")
    for old, new in rename:
        if not old:
            raise ValueError(f"rename {old!r}={new!r}: the old prefix must not be empty")
    check_locations(src, dst, storage_options)
    return chunk_bytes(max_memory)


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
) -> tuple[list[OutTensor], dict[str, Any]]:
    """Output tensors (renamed, cast) and values for a source; ValueError when names collide.

    ``model_only`` keeps the names under ``model.`` when there are any, otherwise drops names
    whose first component is an optimizer root (``optim``, ``optimizer``, ...), and drops all
    non-tensor values. ``rename`` maps prefixes (first match wins).
    """

    def renamed(name: str) -> str:
        for old, new in rename:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    has_model_root = any(n.startswith("model.") for n in source.tensors)
    outputs: dict[str, OutTensor] = {}
    for name, info in sorted(source.tensors.items()):
        if model_only and not _is_model_state(name, has_model_root):
            continue
        out = renamed(name)
        if not out:
            raise ValueError(f"renaming {name!r} leaves an empty name")
        if out in outputs:
            raise ValueError(
                f"tensors {outputs[out].source_name!r} and {name!r} both become {out!r}"
            )
        cast = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
        outputs[out] = OutTensor(TensorInfo(out, info.shape, cast), name)
    values = {} if model_only else {renamed(k): v for k, v in source.values.items()}
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
) -> ConvertResult:
    """Convert the checkpoint at ``src`` (format detected unless ``src_format``) to ``to`` at ``dst``.

    Formats: ``ftsdp``, ``hf``, ``torch``, ``dcp``. ``step`` picks an ftsdp source step (newest by
    default); ``dst_step`` the step written to an ftsdp destination (default: the source's, else
    0). ``dtype`` casts floating tensors; ``world_size`` lays an ftsdp destination out for that
    many ranks; ``max_shard_bytes`` splits hf output. Raises ``FileExistsError`` when ``dst``
    already holds a checkpoint unless ``overwrite``. Memory in flight stays within ``max_memory``
    (see docs/cli.md). ``progress(done, total)`` is called with bytes read. ``src`` and ``dst``
    must not overlap (ValueError). With ``overwrite`` the sink removes only the checkpoint at
    ``dst`` (the files its commit file lists) and replaces files of the names it writes.
    ``trust_pickle`` unpickles a DCP source's ``.metadata`` fully: only for checkpoints you trust.
    """
    chunk = check_options(
        src, dst, to, dtype=dtype, rename=rename, world_size=world_size,
        max_shard_bytes=max_shard_bytes, max_memory=max_memory, storage_options=storage_options,
    )  # fmt: skip
    source = open_source(src, src_format, step, storage_options, chunk, trust_pickle=trust_pickle)
    try:
        outputs, values = select(source, model_only=model_only, rename=rename, dtype=dtype)
        sink = make_sink(
            to, dst, storage_options, world_size=world_size,
            max_shard_bytes=max_shard_bytes, object_bytes=object_bytes, chunk=chunk,
            overwrite=overwrite,
        )  # fmt: skip
        if sink.holds_checkpoint():
            if not overwrite:
                raise FileExistsError(
                    f"{dst} already holds a {to} checkpoint; pass overwrite (--overwrite) to replace it"
                )
            sink.clear()
        total = sum(source.tensors[o.source_name].nbytes for o in outputs)
        meter = Meter(total, progress)
        feed = Feed(source, outputs, chunk, meter)
        if hasattr(source, "order"):  # sources that read whole items prefetch in write order
            source.order = sorted(o.source_name for o in outputs)
        out_step = dst_step if dst_step is not None else (source.step or 0)
        rank_values = source.rank_values if not model_only else []
        written = sink.write(feed, values, rank_values, out_step)
        return ConvertResult(
            source_format=source.format,
            dest_format=to,
            step=out_step if has_steps(to) else None,
            world_size=(world_size or 1) if has_steps(to) else None,
            tensors=len(outputs),
            bytes_read=meter.done,
            written=written,
            dropped=list(source.dropped),
        )
    finally:
        source.close()


def reshard(
    src: str,
    dst: str,
    world_size: int,
    *,
    step: int | None = None,
    **kwargs: Any,
) -> ConvertResult:
    """Rewrite a checkpoint as an ftsdp checkpoint laid out for ``world_size`` ranks, offline.

    Each tensor is split into ``world_size`` even flat ranges, rank ``r`` writing range ``r`` (as a
    sharded save at that world size would); per-rank values are kept for ranks that exist in both.
    Other keyword arguments are those of ``convert``.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    return convert(src, dst, to="ftsdp", step=step, world_size=world_size, **kwargs)
