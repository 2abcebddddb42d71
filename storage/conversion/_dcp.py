"""``torch.distributed.checkpoint`` (DCP) directories as a source and a destination, in one
process (``no_dist=True``), every file through the ``Store`` (``_dcp_store.py``); streamed within
the chunk (docs/cli.md, "Memory"): row blocks in plain items are read as flat ranges, other
tensors whole through ``dcp.load``; written as row blocks resolved one at a time."""

from __future__ import annotations

import functools
import io
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    ChunkStorageMetadata,
    MetadataIndex,
    SavePlan,
    TensorProperties,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ftsdp.storage._errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ftsdp.storage.conversion._dcp_store import StoreReader, StoreWriter, open_item, read_metadata
from ftsdp.storage.conversion._interfaces import Feed, Sink, Source
from ftsdp.storage.conversion._sinks import DCP_ITEM, Pending
from ftsdp.storage.conversion._sources import check_torch_storages
from ftsdp.storage.format._dtypes import SUPPORTED
from ftsdp.storage.format._layout import DCP_METADATA
from ftsdp.storage.format._ranges import Range, check_disjoint_cover
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._streaming import TensorInfo, tensor_bytes


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
                    self.dropped.append(f"{fqn} (dtype {md.properties.dtype} unsupported)")
                    continue
                if not all(type(d) is int and d >= 0 for d in md.size):
                    raise CorruptCheckpointError(
                        f"DCP checkpoint {self.url}: tensor {fqn!r} has size {list(md.size)}, "
                        "not non-negative integers"
                    )
                self.tensors[fqn] = TensorInfo(fqn, tuple(md.size), md.properties.dtype)
            elif isinstance(md, BytesStorageMetadata):
                value_keys.append(fqn)
        if value_keys:
            state: dict[str, Any] = dict.fromkeys(value_keys)
            failed: list[str] = []
            self._load(state, failed)
            for key in value_keys:
                if key in failed:
                    self.dropped.append(f"{key} (not loadable with weights_only=True)")
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
            raise CorruptCheckpointError(
                f"DCP checkpoint {self.url}: read failed ({cause})"
            ) from None

    def _layout(self, name: str) -> list[tuple[int, int, str, int]] | None:
        """(flat offset, length, file, byte offset) of each saved row block; None if not all are."""
        if name in self._layouts:
            return self._layouts[name]
        self._layouts[name] = None
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
                if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.numel() != numel:
                    return None
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
        self._layouts[name] = out
        return out

    def _fill_cache(self, name: str) -> None:
        """Load ``name`` and the tensors after it in ``order`` while they fit in one chunk."""
        self._cache.clear()
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
        self._cache = {n: t.view(-1) for n, t in state.items()}

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        for name, offset, out in requests:
            layout = self._layout(name)
            if layout is None:
                if name not in self._cache:
                    self._fill_cache(name)
                out.copy_(self._cache[name][offset : offset + out.numel()])
                continue
            end = offset + out.numel()
            for flat, numel, path, byte in layout:
                lo, hi = max(offset, flat), min(end, flat + numel)
                if lo < hi:
                    at = byte + (lo - flat) * out.element_size()
                    self.store.read_into(path, at, tensor_bytes(out[lo - offset : hi - offset]))

    def close(self) -> None:
        self._cache.clear()


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
        writer = StoreWriter(self.store, functools.partial(pending.claim, overwrite=self.overwrite))
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
