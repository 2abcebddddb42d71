"""``torch.distributed.checkpoint`` (DCP) directories as a source and a destination in one process
(``no_dist=True``), every file through DCP's storage layer over a ``Store`` (the files torch's
writer writes with ``single_file_per_rank=False``), streamed within the chunk (docs/cli.md,
"Memory"): row blocks in plain items are read as flat ranges, other tensors whole through
``dcp.load``; written as row blocks resolved one at a time.

[Note: DCP's metadata is a pickle]
``.metadata`` is unpickled only in ``unpickle_metadata``, admitting only what ``_admitted`` lists
(``UnsafeCheckpointError`` for anything else, before it is called) unless ``trust_pickle``; then
``check_metadata`` checks it (docs/cli.md, "Threat model").
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import pathlib
import pickle
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    _StorageInfo,
    _StoragePrefix,
    _StorageReaderTransforms,
)
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ftsdp.storage._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
)
from ftsdp.storage._options import MAX_MANIFEST_BYTES
from ftsdp.storage.conversion._interfaces import Feed, Sink, Source
from ftsdp.storage.conversion._sinks import DCP_ITEM, Pending
from ftsdp.storage.conversion._sources import check_torch_storages
from ftsdp.storage.format._dtypes import SUPPORTED
from ftsdp.storage.format._layout import DCP_METADATA
from ftsdp.storage.format._ranges import Range, check_disjoint_cover
from ftsdp.storage.io._fs import Store, is_plain_name
from ftsdp.storage.io._streaming import TensorInfo, tensor_bytes

_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout(name: str) -> torch.layout:
    """A layout by its name, as pickles of layouts call ``torch.serialization._get_layout``."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown torch layout {name!r}")
    return _LAYOUTS[name]


@functools.cache
def _admitted() -> dict[tuple[str, str], Any]:
    """``(module, name)`` -> object: what a pickle of DCP's ``Metadata`` may name."""
    dcp_classes = (
        Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata, BytesStorageMetadata,
        ChunkStorageMetadata, TensorProperties, _MEM_FORMAT_ENCODING,
    )  # fmt: skip
    out: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", c.__name__): c for c in dcp_classes
    }
    out[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    try:  # where older torch's DCP took TensorProperties from
        from torch.distributed._shard.sharded_tensor import metadata as legacy

        for name in ("TensorProperties", "MEM_FORMAT_ENCODING"):
            out[(legacy.__name__, name)] = getattr(legacy, name)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch version
        pass
    out[("torch", "Size")] = torch.Size
    out.update((("torch", n), v) for n, v in vars(torch).items() if isinstance(v, torch.dtype))
    out[("torch.serialization", "_get_layout")] = _layout
    for module in ("pathlib", "pathlib._local"):  # a checkpoint id saved as a Path
        for cls in (pathlib.PurePosixPath, pathlib.PosixPath):
            out[(module, cls.__name__)] = cls
    out.update((("builtins", c.__name__), c) for c in (dict, list, tuple, set, frozenset))
    out[("collections", "OrderedDict")] = OrderedDict
    return out


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what ``_admitted`` lists, unless ``trust`` (see the note)."""

    def __init__(self, data: bytes, where: str, trust: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.where, self.trust = where, trust

    def find_class(self, module: str, name: str) -> Any:
        if self.trust:
            return super().find_class(module, name)
        admitted = _admitted().get((module, name))
        if admitted is None:
            raise UnsafeCheckpointError(
                f"{self.where}: refusing to unpickle {module}.{name}, which DCP's metadata is not "
                "made of (unpickling it could run code from the checkpoint). If you trust this "
                "checkpoint, open it with trust_pickle=True (ftsdp-ckpt --trust-pickle)"
            )
        return admitted


def unpickle_metadata(
    data: bytes, where: str = ".metadata", trust_pickle: bool = False
) -> Metadata:
    """DCP's checked ``.metadata`` from its bytes (see the note); ``where`` names the file in
    errors: ``UnsafeCheckpointError`` for what is refused, ``CorruptCheckpointError`` else."""
    try:
        metadata = _MetadataUnpickler(data, where, trust_pickle).load()
    except CheckpointError:
        raise
    except Exception as e:  # the unpickler's errors are many and unrelated to each other
        raise CorruptCheckpointError(f"{where}: not a valid DCP metadata pickle ({e!r})") from None
    check_metadata(metadata, where)
    return metadata


def _sizes(value: Any, rank: int | None = None) -> bool:
    """A sequence of non-negative ints (of ``rank`` entries when given)."""
    return (
        isinstance(value, (torch.Size, tuple, list))
        and (rank is None or len(value) == rank)
        and all(type(v) is int and v >= 0 for v in value)
    )


def check_metadata(metadata: Any, where: str) -> None:
    """CorruptCheckpointError unless ``metadata`` is a DCP ``Metadata`` whose fields have their
    types, whose chunks lie inside their tensors and whose ``storage_data`` points only at plain
    file names in the checkpoint's folder, by non-negative byte ranges."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: {what}")

    if not isinstance(metadata, Metadata):
        raise bad(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"item name {fqn!r} is not a str")
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise bad(f"item {fqn!r} has metadata of type {type(md).__name__}")
        if not (
            isinstance(getattr(md.properties, "dtype", None), torch.dtype)
            and _sizes(md.size)
            and isinstance(md.chunks, list)
        ):
            raise bad(f"tensor {fqn!r}: malformed properties, size or chunks")
        for c in md.chunks:
            if not (
                isinstance(c, ChunkStorageMetadata)
                and _sizes(c.offsets, len(md.size))
                and _sizes(c.sizes, len(md.size))
                and all(o + n <= d for o, n, d in zip(c.offsets, c.sizes, md.size, strict=True))
            ):
                raise bad(f"tensor {fqn!r}: a chunk is malformed or outside {list(md.size)}")
    if not isinstance(metadata.storage_data, dict):
        raise bad("storage_data is not a dict (not written by DCP's file system storage)")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage_data entry {index!r}: not a MetadataIndex -> _StorageInfo")
        if not is_plain_name(info.relative_path):
            raise bad(
                f"item {index.fqn!r} points to {info.relative_path!r}, not a plain file name in "
                "the checkpoint's folder; refusing to read outside it"
            )
        if not _sizes([info.offset, info.length]):
            raise bad(f"item {index.fqn!r}: byte range {info.offset!r}+{info.length!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and not (
            isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors)
        ):
            raise bad(f"item {index.fqn!r}: transform_descriptors are not strings")


def open_item(store: Store, info: _StorageInfo) -> IO[bytes]:
    """One saved item's bytes (its ``storage_data`` entry, checked by ``check_metadata``) as a
    seekable file (cast: typeshed counts no ``io.RawIOBase`` as ``IO[bytes]``)."""
    return cast(IO[bytes], store.open(info.relative_path, info.offset, info.offset + info.length))


def read_metadata(store: Store, trust_pickle: bool = False) -> Metadata:
    """The checked ``.metadata`` at the store's root (FileNotFoundError when absent)."""
    data = store.read_bounded(DCP_METADATA, MAX_MANIFEST_BYTES)
    return unpickle_metadata(data, store.where(DCP_METADATA), trust_pickle)


def _done(value: Any = None) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class _OnStore:
    """What the reader and the writer share: the store, and its URL as DCP's checkpoint id."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store

    @property
    def checkpoint_id(self) -> str:
        return self.store.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP's own guessing: it is passed explicitly

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan


class StoreReader(_OnStore, StorageReader):
    """Reads a DCP checkpoint at the store's root, each item as a seekable byte range."""

    def __init__(
        self, store: Store, metadata: Metadata | None = None, trust_pickle: bool = False
    ) -> None:
        super().__init__(store)
        self._metadata = metadata  # already read: not read again
        self.trust_pickle = trust_pickle
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.load_id = uuid.uuid4().hex
        self.transforms = _StorageReaderTransforms()  # torch's, for items written with extensions

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data, self.load_id = {}, uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata or read_metadata(self.store, self.trust_pickle)
        # getattr: a .metadata pickled by an older torch has no storage_meta at all
        meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        metadata.storage_meta = meta
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            with open_item(self.store, info) as raw:
                stream = self.transforms.transform_load_stream(
                    req, info.transform_descriptors or (), raw
                )
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(stream.read()))
                    continue
                if not stream.seekable():  # torch.load needs to seek
                    stream = io.BytesIO(stream.read())
                tensor = torch.load(stream, map_location="cpu", weights_only=True)
            for dim, (offset, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                if length < tensor.size(dim):
                    tensor = tensor.narrow(dim, offset, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ValueError(
                    f"DCP item {req.storage_index}: {tuple(tensor.size())} elements saved, "
                    f"{tuple(target.size())} wanted"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        return _done()


class StoreWriter(_OnStore, StorageWriter):
    """Writes a DCP checkpoint at the store's root: one file per item, resolved one at a time,
    ``.metadata`` last."""

    def __init__(
        self, store: Store, claim: Callable[[list[str]], None], check: Callable[[], None]
    ) -> None:
        super().__init__(store)
        self.save_id = uuid.uuid4().hex
        self.claim = claim  # told every item file's name before the first is written
        self.check = check  # called before the commit (raises to refuse it)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.store.url, save_id=self.save_id)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        names = [f"{plan.storage_data.prefix}{n}.distcp" for n in range(len(plan.items))]
        self.claim(names)
        results = []
        for name, item in zip(names, plan.items, strict=True):
            length = self._write_item(name, item, planner.resolve_data(item))
            results.append(WriteResult(item.index, length, _StorageInfo(name, 0, length)))
        return _done(results)

    def _write_item(self, name: str, item: WriteItem, data: Any) -> int:
        """Write one item as the file ``name``; its length (its data freed on return)."""
        if isinstance(data, torch.Tensor):
            data = data.detach().cpu()
            if data.untyped_storage().nbytes() != data.nbytes:
                data = data.clone()  # torch.save writes a view's whole storage
        length = 0

        def produce(f: Any) -> None:
            nonlocal length
            if item.type == WriteItemType.BYTE_IO:
                f.write(data.getbuffer())
            else:
                torch.save(data, f)
            length = f.tell()

        self.store.write(name, produce)
        return length

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        self.check()
        self.store.write_bytes(DCP_METADATA, pickle.dumps(metadata))  # the commit


class _SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """Loads non-tensor items with ``weights_only=True`` and records those that need more."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True
        )
        self.failed = failed

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=True)
        except Exception:
            self.failed.append(fqn)


class DcpSource(Source):
    """A DCP checkpoint directory of any world size and chunking."""

    format = "dcp"

    def __init__(self, store: Store, chunk: int = 32 << 20, trust_pickle: bool = False) -> None:
        super().__init__(store)
        self._chunk = chunk
        try:
            self._meta = StoreReader(store, trust_pickle=trust_pickle).read_metadata()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"DCP checkpoint {self.url} has no .metadata") from None
        except CheckpointError:
            raise
        except Exception as e:
            raise CorruptCheckpointError(
                f"DCP checkpoint {self.url}: cannot read .metadata ({e})"
            ) from None
        self._cache: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, list[tuple[int, int, str, int]] | None] = {}
        value_keys = []
        for fqn, md in self._meta.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                if md.properties.dtype not in SUPPORTED:
                    self.dropped[fqn] = f"dtype {md.properties.dtype} unsupported"
                    continue
                self.tensors[fqn] = TensorInfo(fqn, tuple(md.size), md.properties.dtype)
            elif isinstance(md, BytesStorageMetadata):
                value_keys.append(fqn)
        if value_keys:
            state: dict[str, Any] = dict.fromkeys(value_keys)
            failed: list[str] = []
            self._load(state, failed)
            for key in value_keys:
                if key in failed:
                    self.dropped[key] = "not loadable with weights_only=True"
                else:
                    self.keep_value(key, state[key])
        self.order = list(self.tensors)

    def _load(self, state: dict[str, Any], failed: list[str]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
                reader, planner = StoreReader(self.store, self._meta), _SafeLoadPlanner(failed)
                dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            cause = _unwrap(e)
            if not isinstance(cause, Exception):
                raise cause from None
            if isinstance(cause, OSError) and (incomplete := self._incomplete()) is not None:
                raise incomplete from None
            raise CorruptCheckpointError(
                f"DCP checkpoint {self.url}: read failed ({cause})"
            ) from None

    def _incomplete(self) -> IncompleteCheckpointError | None:
        """IncompleteCheckpointError for the first item file ``.metadata`` lists that is missing
        or ends before its items (what a short read met); None when every one is whole."""
        ends: dict[str, int] = {}  # each item file -> the end of its last item
        for info in self._meta.storage_data.values():
            end = info.offset + info.length
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
        listing = self.store.listdir()
        for path, end in sorted(ends.items()):
            where = f"DCP checkpoint {self.url}: item file {path!r}"
            if path not in listing:
                return IncompleteCheckpointError(
                    f"{where}, listed in .metadata, is missing: an interrupted or partial copy; "
                    "copy the checkpoint again"
                )
            if listing[path][1] < end:
                return IncompleteCheckpointError(
                    f"{where} has {listing[path][1]} bytes, .metadata lists items up to byte "
                    f"{end}: it is truncated (an interrupted or partial copy); copy the "
                    "checkpoint again"
                )
        return None

    def _layout(self, name: str) -> list[tuple[int, int, str, int]] | None:
        """(flat offset, length, file, byte offset) of each saved row block; None unless every
        block's item is a tensor of exactly the chunk's shape and ``.metadata``'s dtype (DCP's own
        reader casts an item into that dtype, which a converting planner relies on)."""
        if name not in self._layouts:  # threads finding it at once compute the same
            self._layouts[name] = self._find_layout(name)
        return self._layouts[name]

    def _find_layout(self, name: str) -> list[tuple[int, int, str, int]] | None:
        md = self._meta.state_dict_metadata[name]
        assert isinstance(md, TensorStorageMetadata), name  # asked for tensors only
        shape = tuple(md.size)
        row = math.prod(shape[1:])
        out = []
        for c in md.chunks:
            if any(c.offsets[1:]) or tuple(c.sizes[1:]) != shape[1:]:
                return None
            info = self._meta.storage_data.get(MetadataIndex(name, c.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return None
            with open_item(self.store, info) as f:
                if f.read(4) != b"PK\x03\x04":
                    return None
                f.seek(0)
                where = f"DCP checkpoint {self.url}: item {info.relative_path!r}"
                try:
                    t = torch.load(f, map_location="meta", weights_only=True)
                except Exception as e:  # the unpickler's and zip reader's errors are many
                    raise CorruptCheckpointError(f"{where} cannot be read: {e}") from None
                numel = math.prod(c.sizes)
                if (
                    not isinstance(t, torch.Tensor)
                    or not t.is_contiguous()
                    or tuple(t.shape) != tuple(c.sizes)
                    or t.dtype != md.properties.dtype
                ):
                    return None
                # t has the metadata's dtype: its bytes, read with the metadata's item size,
                # lie inside the item's storage record
                check_torch_storages(f, info.length, [(name, t)], where)
            base = t.untyped_storage()._checkpoint_offset
            assert base is not None, name  # check_torch_storages found its record
            start = base + t.storage_offset() * t.element_size()
            flat = (c.offsets[0] if shape else 0) * row
            out.append((flat, numel, info.relative_path, info.offset + start))
        out.sort()
        try:  # the chunks must tile the tensor
            check_disjoint_cover([Range(f, n) for f, n, _, _ in out], math.prod(shape), name)
        except ValueError:
            return None
        return out

    def _fill_cache(self, name: str) -> dict[str, torch.Tensor]:
        """Load ``name`` and the tensors after it in ``order`` that fit in one chunk into a new
        cache, which replaces the old one whole (a thread copying from the old one keeps it)."""
        self._cache = {}  # freed before the next is read (unless in use)
        start = self.order.index(name) if name in self.order else 0
        batch, used = [name], self.tensors[name].nbytes
        for other in self.order[start + 1 :]:
            nbytes = self.tensors[other].nbytes
            if used + nbytes > self._chunk or self._layout(other) is not None:
                break
            batch.append(other)
            used += nbytes
        state = {n: torch.empty(self.tensors[n].shape, dtype=self.tensors[n].dtype) for n in batch}
        self._load(state, [])
        self._cache = cache = {n: t.view(-1) for n, t in state.items()}
        return cache

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        """Row blocks of plain items as flat ranges, other tensors through DCP;
        IncompleteCheckpointError when a read meets a missing or truncated item file."""
        try:
            for name, offset, out in requests:
                layout = self._layout(name)
                if layout is None:
                    cache = self._cache  # taken once: another thread may replace it meanwhile
                    if name not in cache:
                        cache = self._fill_cache(name)
                    out.copy_(cache[name][offset : offset + out.numel()])
                    continue
                end = offset + out.numel()
                for flat, numel, path, byte in layout:
                    lo, hi = max(offset, flat), min(end, flat + numel)
                    if lo < hi:
                        at = byte + (lo - flat) * out.element_size()
                        self.store.read_into(path, at, tensor_bytes(out[lo - offset : hi - offset]))
        except CheckpointError:
            raise
        except OSError:
            incomplete = self._incomplete()
            if incomplete is None:
                raise
            raise incomplete from None

    def close(self) -> None:
        self._cache = {}


class _StreamingSavePlanner(dcp.DefaultSavePlanner):
    """Plans row blocks of tensors known only by shape and dtype; resolves each on demand."""

    def __init__(
        self,
        tensors: list[TensorInfo],
        values: dict[str, Any],
        block: Callable[[TensorInfo, int, int], torch.Tensor],
        chunk: int,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._tensors, self._values, self._block, self._chunk = tensors, values, block, chunk
        self._by_name = {t.name: t for t in tensors}

    def create_local_plan(self) -> SavePlan:
        items = []
        for t in self._tensors:
            shape = torch.Size(t.shape)
            props = TensorProperties(dtype=t.dtype)
            rows = shape[0] if shape else 1
            row_bytes = max(1, t.nbytes // rows) if rows else 1
            step = max(1, self._chunk // row_bytes)
            for r0 in range(0, max(rows, 1), step):
                n = min(step, rows - r0)
                offsets = torch.Size([r0, *[0] * (len(shape) - 1)]) if shape else torch.Size([])
                sizes = torch.Size([n, *shape[1:]]) if shape else torch.Size([])
                data = TensorWriteData(ChunkStorageMetadata(offsets, sizes), props, shape)
                kind = WriteItemType.TENSOR if n == rows else WriteItemType.SHARD
                items.append(WriteItem(MetadataIndex(t.name, offsets), kind, tensor_data=data))
        for name in self._values:
            items.append(WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        name = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self._values[name], buf)
            buf.seek(0)
            return buf
        info = self._by_name[name]
        assert write_item.tensor_data is not None, name  # every other item is a tensor's
        chunk = write_item.tensor_data.chunk
        row = math.prod(info.shape[1:])
        first = chunk.offsets[0] if info.shape else 0
        n = math.prod(chunk.sizes)
        return self._block(info, first * row, n).view(chunk.sizes)


class DcpSink(Sink):
    """A DCP checkpoint directory (see [Note: a sink deletes only what it wrote])."""

    def __init__(self, store: Store, overwrite: bool = False) -> None:
        super().__init__(store)
        self.overwrite = overwrite

    def existing(self) -> list[str]:
        """``.metadata`` first, then the files it lists."""
        if not self.store.isdir():
            return []
        listing = self.store.listdir()
        if DCP_METADATA not in listing:
            return []
        try:
            metadata = read_metadata(self.store)
        except (CheckpointError, OSError):
            return [DCP_METADATA]
        files = {info.relative_path for info in metadata.storage_data.values()}
        return [DCP_METADATA, *sorted(f for f in files if f in listing and f != DCP_METADATA)]

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int
    ) -> list[str]:
        """Write the checkpoint, ``.metadata`` last; the item files are claimed before the first."""
        pending = Pending(self.store, DCP_ITEM)
        claim = functools.partial(pending.claim, overwrite=self.overwrite)
        writer = StoreWriter(self.store, claim, pending.check)
        planner = _StreamingSavePlanner(feed.infos, values, feed.block, feed.chunk)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
                dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:
            raise _unwrap(e) from None
        pending.release()
        return [self.store.url]


def _unwrap(error: BaseException) -> BaseException:
    """The original error inside DCP's ``CheckpointException`` (which wraps even ^C)."""
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return inner
    return error
