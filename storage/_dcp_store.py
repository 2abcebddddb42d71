"""DCP's storage layer over a ``Store``: ``torch.distributed.checkpoint`` reads and writes its
files through ours, so a DCP checkpoint gets the same retries and atomic writes as every format.

torch's ``FileSystemReader``/``FsspecReader`` and ``FileSystemWriter``/``FsspecWriter`` do their
own I/O; these two small classes do the same job through the store. The files they write are
what torch's writer writes with ``single_file_per_rank=False`` and ``thread_count=1`` (one
``torch.save`` file per item, ``__<rank>_<n>.distcp``, and a pickled ``Metadata`` in
``.metadata``, written last), so torch's own readers read them and ours read torch's.

[Note: DCP's metadata is a pickle]
``.metadata`` is a pickled ``Metadata`` (DCP's own format) and unpickling it can run code from
the checkpoint, as torch's own readers do (docs/design.md, "Trust model": open). It is loaded in
one place, ``unpickle_metadata``, so that a restricted unpickler can replace it there.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    _StorageInfo,
    _StoragePrefix,
    _StorageReaderTransforms,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ftsdp.storage._fs import RangeFile, Store
from ftsdp.storage._layout import DCP_METADATA


def unpickle_metadata(data: bytes) -> Metadata:
    """DCP's ``.metadata`` from its bytes: a plain ``pickle.loads``, exactly as trusting as
    torch's readers (see [Note: DCP's metadata is a pickle])."""
    return pickle.loads(data)


def open_item(store: Store, info: _StorageInfo) -> RangeFile:
    """The bytes of one saved item (its ``storage_data`` entry) as a seekable file."""
    return store.open(info.relative_path, info.offset, info.offset + info.length)


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


class StoreReader(_OnStore, StorageReader):
    """Reads a DCP checkpoint at the store's root: ``.metadata`` whole, each item as a byte range
    (a seekable view ``torch.load`` reads from; a large tensor's bytes go straight into it)."""

    def __init__(self, store: Store, metadata: Metadata | None = None) -> None:
        super().__init__(store)
        self._metadata = metadata  # already read: not read again
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.load_id = uuid.uuid4().hex
        self.transforms = _StorageReaderTransforms()  # torch's, for items written with extensions

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data, self.load_id = {}, uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata or unpickle_metadata(self.store.read(DCP_METADATA))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise ValueError(f"DCP checkpoint {self.store.url}: .metadata has no storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

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
    """Writes a DCP checkpoint at the store's root: one file per item, ``.metadata`` last (DCP's
    commit), each file atomic and retried by the store. Items are resolved one at a time, so the
    writer holds one item (see [Note: streaming DCP] in ``storage/_dcp.py``)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.store.url, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = []
        for n, item in enumerate(plan.items):
            name = f"{plan.storage_data.prefix}{n}.distcp"
            length = self._write_item(name, item, planner.resolve_data(item))
            results.append(WriteResult(item.index, length, _StorageInfo(name, 0, length)))
        return _done(results)

    def _write_item(self, name: str, item: WriteItem, data: Any) -> int:
        """Write one item as the file ``name``; its length. Its data is freed on return, before
        the next item is resolved."""
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
        self.store.write_bytes(DCP_METADATA, pickle.dumps(metadata))  # the commit
