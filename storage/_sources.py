"""Readers of every checkpoint format the tools understand, behind one interface.

A ``Source`` knows its tensors (name, shape, dtype) and non-tensor values without reading tensor
data, and fills caller-owned 1-D buffers with flat ranges of its tensors (``read_into``). Formats:
``ftsdp`` (this package's, checksums verified), ``hf`` (safetensors files, optionally with a
``model.safetensors.index.json``), ``torch`` (a ``torch.save`` zip file, opened with
``weights_only=True``; bytes are read at their offsets, never unpickled as data) and ``dcp``
(``torch.distributed.checkpoint``, in ``storage/_dcp.py``).
"""

from __future__ import annotations

import abc
import json
import re
import struct
from collections.abc import Sequence
from typing import Any

import torch

from ftsdp.storage._dtypes import BY_SAFETENSORS_CODE, torch_dtype
from ftsdp.storage._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import LATEST, parse_step
from ftsdp.storage._options import IOOptions
from ftsdp.storage._ranges import Range
from ftsdp.storage._read_plan import Want, plan_reads
from ftsdp.storage._reader import execute
from ftsdp.storage._steps import resolve_manifest
from ftsdp.storage._streaming import TensorInfo, read_range_into, url_to_fs

FORMATS = ("ftsdp", "hf", "torch", "dcp")
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
SHARD_NAME = re.compile(r"^model-\d+-of-\d+\.safetensors$")  # hf shards (need the index)
VALUES_KEY = "ftsdp.values"  # safetensors __metadata__ key holding non-tensor values (JSON)


class Source(abc.ABC):
    """A checkpoint opened for reading (see the module docstring)."""

    format: str = ""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tensors: dict[str, TensorInfo] = {}
        self.values: dict[str, Any] = {}
        self.step: int | None = None
        self.world_size: int | None = None
        self.rank_values: list[dict[str, Any]] = []
        self.dropped: list[str] = []  # entries that cannot be represented (named in reports)

    @abc.abstractmethod
    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """Fill each ``out`` (1-D, contiguous, CPU, the tensor's dtype) with elements
        ``[offset, offset + out.numel())`` of tensor ``name``."""

    def close(self) -> None:  # noqa: B027 - optional: most sources hold nothing to release
        """Release what the reader holds (files, caches)."""


class FtsdpSource(Source):
    """One committed step of a checkpoint root in this package's format."""

    format = "ftsdp"

    def __init__(
        self, url: str, step: int | None, storage_options: dict | None, io: IOOptions | None = None
    ) -> None:
        super().__init__(url)
        self.store = Store(url, storage_options, io)
        self.manifest = resolve_manifest(self.store, step)
        m = self.manifest
        self.step, self.world_size = m.step, m.world_size
        self.values, self.rank_values = dict(m.values), [dict(v) for v in m.rank_values]
        self.tensors = {
            n: TensorInfo(n, t.shape, torch_dtype(t.dtype)) for n, t in m.tensors.items()
        }

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        wants = [
            Want(name, self.manifest.tensors[name], Range(offset, out.numel()), out)
            for name, offset, out in requests
            if out.numel()
        ]
        block = self.manifest.checksum_block_bytes
        execute(self.store, self.manifest.step, block, plan_reads(wants, block))


def read_safetensors_header(fs: Any, path: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte offset where its data starts."""
    where = f"safetensors file {path}"
    try:
        head = fs.cat_file(path, start=0, end=8)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{where} does not exist") from None
    if len(head) < 8:
        raise CorruptCheckpointError(f"{where} is shorter than 8 bytes: not a safetensors file")
    (n,) = struct.unpack("<Q", head)
    size = fs.size(path)
    if n > min(size - 8, 100 << 20):
        raise CorruptCheckpointError(
            f"{where}: header length {n} is past the end of the file ({size} bytes)"
        )
    try:
        header = json.loads(fs.cat_file(path, start=8, end=8 + n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    data_len = size - 8 - n
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} has data_offsets {offsets} outside the {data_len} data "
                "bytes (truncated or corrupt file)"
            )
    return header, 8 + n


class HfSource(Source):
    """Safetensors: one file, a directory with one file, or shards listed by an index."""

    format = "hf"

    def __init__(self, url: str, storage_options: dict | None) -> None:
        super().__init__(url)
        self.fs, path = url_to_fs(url, storage_options)
        if path.endswith(".safetensors") and self.fs.isfile(path):
            files = [path]
        elif self.fs.exists(f"{path}/{HF_INDEX}"):
            try:
                index = json.loads(self.fs.cat_file(f"{path}/{HF_INDEX}"))
                files = sorted({f"{path}/{f}" for f in index["weight_map"].values()})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise CorruptCheckpointError(
                    f"{url}/{HF_INDEX}: not a valid index ({e!r})"
                ) from None
        else:
            files = sorted(p for p in self.fs.ls(path, detail=False) if p.endswith(".safetensors"))
            if any(SHARD_NAME.match(f.rsplit("/", 1)[-1]) for f in files):
                raise IncompleteCheckpointError(
                    f"{url} holds hf shards but no {HF_INDEX}: an interrupted or partial copy"
                )
        if not files:
            raise CheckpointNotFoundError(f"no .safetensors file at {url}")
        self._where: dict[str, tuple[str, int, int]] = {}  # name -> (file, data start, byte start)
        for file in files:
            header, base = read_safetensors_header(self.fs, file)
            meta = header.pop("__metadata__", None) or {}
            if isinstance(meta.get(VALUES_KEY), str):
                self.values.update(json.loads(meta[VALUES_KEY]))
            for name, entry in header.items():
                if entry.get("dtype") not in BY_SAFETENSORS_CODE:
                    self.dropped.append(
                        f"{name} (safetensors dtype {entry.get('dtype')} unsupported)"
                    )
                    continue
                info = TensorInfo(name, tuple(entry["shape"]), BY_SAFETENSORS_CODE[entry["dtype"]])
                start, end = entry["data_offsets"]
                if end - start != info.nbytes:
                    raise CorruptCheckpointError(
                        f"safetensors file {file}: tensor {name!r} shape {list(info.shape)} "
                        f"{entry['dtype']} needs {info.nbytes} bytes, data_offsets hold {end - start}"
                    )
                if name in self.tensors:
                    raise CorruptCheckpointError(f"tensor {name!r} appears in two files of {url}")
                self.tensors[name] = info
                self._where[name] = (file, base, start)

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        for name, offset, out in requests:
            file, base, start = self._where[name]
            read_range_into(self.fs, file, base + start + offset * out.element_size(), out)


class TorchSource(Source):
    """A ``torch.save`` zip file; structure read with ``weights_only=True`` on the meta device."""

    format = "torch"

    def __init__(self, url: str, storage_options: dict | None) -> None:
        super().__init__(url)
        self.fs, self.path = url_to_fs(url, storage_options)
        try:
            with self.fs.open(self.path, "rb") as f:
                obj = torch.load(f, map_location="meta", weights_only=True)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"torch file {url} does not exist") from None
        except Exception as e:  # the unpickler's errors are many and unrelated to each other
            raise CorruptCheckpointError(
                f"torch file {url} cannot be read with weights_only=True: {e}"
            ) from None
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(
                f"torch file {url} holds a {type(obj).__name__}, not a state dict"
            )
        self._meta: dict[str, torch.Tensor] = {}
        self._cache: tuple[str, torch.Tensor] | None = None
        self._walk("", obj)

    def _walk(self, prefix: str, obj: Any) -> None:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, torch.Tensor):
                if value.dtype not in BY_SAFETENSORS_CODE.values():
                    self.dropped.append(f"{name} (dtype {value.dtype} unsupported)")
                    continue
                self._meta[name] = value
                self.tensors[name] = TensorInfo(name, tuple(value.shape), value.dtype)
            elif isinstance(value, dict) or (
                isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)
            ):
                self._walk(name, value)
            else:
                try:
                    self.values[name] = json.loads(json.dumps(value))
                except (TypeError, ValueError):
                    self.dropped.append(f"{name} ({type(value).__name__} is not JSON)")

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        for name, offset, out in requests:
            meta = self._meta[name]
            base = meta.untyped_storage()._checkpoint_offset
            size = out.element_size()
            if meta.is_contiguous():
                read_range_into(
                    self.fs, self.path, base + (meta.storage_offset() + offset) * size, out
                )
                continue
            # [Note: strided tensors in torch files] A view saved with its storage cannot be read
            # as one flat range: read the storage once, keep the contiguous copy for the next chunk.
            if self._cache is None or self._cache[0] != name:
                self._cache = None
                raw = torch.empty(meta.untyped_storage().nbytes() // size, dtype=meta.dtype)
                read_range_into(self.fs, self.path, base, raw)
                full = raw.as_strided(meta.shape, meta.stride(), meta.storage_offset()).contiguous()
                self._cache = (name, full.view(-1))
            out.copy_(self._cache[1][offset : offset + out.numel()])

    def close(self) -> None:
        self._cache = None


def detect_format(url: str, storage_options: dict | None = None) -> str:
    """``ftsdp``, ``hf``, ``torch`` or ``dcp`` for what lies at ``url`` (ValueError when none)."""
    fs, path = url_to_fs(url, storage_options)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        raise CheckpointNotFoundError(f"no checkpoint at {url}: it does not exist")
    if fs.isfile(path):
        with fs.open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"PK\x03\x04":
            return "torch"
        if path.endswith(".safetensors"):
            return "hf"
        raise ValueError(
            f"cannot tell the format of the file {url}: not a torch.save zip file nor .safetensors "
            "(legacy non-zip torch files are not supported; re-save them with torch.save)"
        )
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
    if ".metadata" in names:
        return "dcp"
    if LATEST in names or any(parse_step(n) is not None for n in names):
        return "ftsdp"
    if HF_INDEX in names or any(n.endswith(".safetensors") for n in names):
        return "hf"
    if "manifest.json" in names:
        raise ValueError(
            f"{url} is a step directory; pass its parent (the checkpoint root) and --step"
        )
    raise ValueError(
        f"no checkpoint found at {url}: expected step-<N>/ dirs (ftsdp), .metadata (dcp), "
        "*.safetensors (hf) or a torch.save file"
    )


def open_source(
    url: str,
    fmt: str | None = None,
    step: int | None = None,
    storage_options: dict | None = None,
    chunk: int = 32 << 20,
) -> Source:
    """Open ``url`` as format ``fmt`` (None: detected); ``step`` applies to ftsdp only; ``chunk``
    bounds what a source that reads whole items may hold at once."""
    fmt = fmt or detect_format(url, storage_options)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    if step is not None and fmt != "ftsdp":
        raise ValueError(f"a step was given but {url} is a {fmt} checkpoint, which has no steps")
    if fmt == "ftsdp":
        return FtsdpSource(url, step, storage_options)
    if fmt == "hf":
        return HfSource(url, storage_options)
    if fmt == "torch":
        return TorchSource(url, storage_options)
    from ftsdp.storage._dcp import DcpSource  # imports torch.distributed.checkpoint (a second)

    return DcpSource(url, storage_options, chunk)
