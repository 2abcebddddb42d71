"""Readers of the ``ftsdp``, ``hf`` and ``torch`` formats (``dcp`` is in ``_dcp.py``); every
pointer a checkpoint holds is checked before it is read through (docs/cli.md, "Threat model")."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import IO, cast

import torch

from ftsdp.storage._errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ftsdp.storage._options import MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, LoadOptions
from ftsdp.storage.conversion._interfaces import Source
from ftsdp.storage.format._dtypes import BY_SAFETENSORS_CODE, torch_dtype
from ftsdp.storage.format._grid import Box, Cuts, whole
from ftsdp.storage.format._json import decode_json, show
from ftsdp.storage.format._layout import HF_INDEX, HF_SHARD, HF_SINGLE, HF_VALUES_KEY
from ftsdp.storage.format._ranges import Range
from ftsdp.storage.format._safetensors import read_header
from ftsdp.storage.format._steps import resolve_manifest
from ftsdp.storage.io._fs import Store, is_plain_name
from ftsdp.storage.io._streaming import TensorInfo, tensor_bytes
from ftsdp.storage.loading._read_plan import Want, plan_reads
from ftsdp.storage.loading._reader import execute


def check_torch_storages(
    f: IO[bytes], size: int, tensors: Iterable[tuple[str, torch.Tensor]], where: str
) -> None:
    """CorruptCheckpointError unless each tensor (loaded on meta from the ``torch.save`` zip file
    ``f`` of ``size`` bytes) lies inside its storage, and each storage inside its ``data/<key>``
    record of the file: a crafted pickle may claim any storage size."""
    f.seek(0)
    reader = torch._C.PyTorchFileReader(f)
    records = {}  # data offset -> size of each storage record
    for name in reader.get_all_records():
        if name.startswith("data/"):
            # get_record_offset: in torch's C++ reader, missing from its stub
            offset = reader.get_record_offset(name)  # type: ignore[attr-defined]
            records[offset] = reader.get_record_size(name)
    for name, t in tensors:
        storage = t.untyped_storage()
        base, nbytes = storage._checkpoint_offset, storage.nbytes()
        extent = t.storage_offset() + sum(
            (n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)
        )
        if (
            not isinstance(base, int)
            or (record := records.get(base)) is None
            or not nbytes <= record <= size - base
            or t.storage_offset() < 0
            or (t.numel() and (extent + 1) * t.element_size() > nbytes)
        ):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} (shape {list(t.shape)}, storage offset "
                f"{t.storage_offset()}, {nbytes} storage bytes at {base}) does not lie inside "
                "its storage record"
            )


def _holding_tensors(obj: dict) -> set[int]:
    """The ids of the containers (dicts, lists, tuples) in ``obj`` holding a tensor at some depth,
    each walked once, without recursion (an unpickled structure may share, loop or nest deeply)."""
    holders: set[int] = set()
    seen = {id(obj)}
    stack: list[tuple[object, Iterator]] = [(obj, iter(obj.values()))]
    while stack:
        for child in stack[-1][1]:
            container = isinstance(child, (dict, list, tuple))
            if container and id(child) not in holders:
                if id(child) in seen:
                    continue  # walked (held no tensor), or a loop back to what holds it
                seen.add(id(child))
                stack.append((child, iter(child.values() if isinstance(child, dict) else child)))
                break
            if container or isinstance(child, torch.Tensor):  # a tensor, or what holds one
                for held, _ in reversed(stack):  # the container and those holding it
                    if id(held) in holders:
                        break  # so are those below it
                    holders.add(id(held))
        else:
            stack.pop()  # every child seen
    return holders


class FtsdpSource(Source):
    """One committed step (``step``; None: the newest) of an ftsdp checkpoint root."""

    format = "ftsdp"

    def __init__(self, store: Store, step: int | None, options: LoadOptions | None = None) -> None:
        super().__init__(store)
        m = self.manifest = resolve_manifest(store, step, options)
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
        execute(self.store, self.manifest, plan_reads(wants, self.manifest.checksum_block_bytes))

    def exact_boxes(self, name: str, cuts: Cuts) -> bool:
        """True when each dim but the first of ``cuts`` is cut only where the saved grid (or
        the row-major order) cuts it: a box is then whole rows of every saved cell it meets, so
        its read is a run per cell (a box that is a column strip of a saved cell would be a run,
        a read, a copy and a task per row: read through its rows instead)."""
        entry = self.manifest.tensors[name]
        saved = entry.grid or whole(entry.shape)
        return all(set(cuts[d]) <= set(saved[d]) for d in range(1, len(entry.shape)))

    def read_boxes_into(self, requests: Sequence[tuple[str, Box, torch.Tensor]]) -> None:
        """Exactly the bytes of each box (from any saved layout: see ``plan_reads``)."""
        wants = [
            Want(name, self.manifest.tensors[name], Range(0, box.numel), out, box)
            for name, box, out in requests
            if box.numel
        ]
        execute(self.store, self.manifest, plan_reads(wants, self.manifest.checksum_block_bytes))


class HfSource(Source):
    """Safetensors: one file, a directory with an index and the shards it lists, else its
    ``model.safetensors``, else its ``.safetensors`` files."""

    format = "hf"

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        url = store.url
        index_map: dict[str, str] = {}  # an index's weight_map: each name in its named shard
        if url.endswith(".safetensors") and store.isfile():
            files = [""]  # the store is rooted at the file itself
        elif store.exists(HF_INDEX):
            where = f"{url}/{HF_INDEX}"
            index = decode_json(
                store.read_bounded(HF_INDEX, MAX_MANIFEST_BYTES), where=where, what="index"
            )
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not (
                isinstance(weight_map, dict)
                and all(isinstance(f, str) for f in weight_map.values())
            ):
                raise CorruptCheckpointError(
                    f"{where}: not a valid index (its weight_map must map tensor names to file "
                    f"names, got {show(weight_map)})"
                )
            index_map, files = weight_map, sorted(set(weight_map.values()))
            outside = [f for f in files if not is_plain_name(f)]
            if outside:
                raise CorruptCheckpointError(
                    f"{url}/{HF_INDEX} lists {outside}: not plain file names in the checkpoint's "
                    "folder; refusing to read outside it"
                )
            listing = store.listdir()
            missing = [f for f in files if f not in listing]
            if missing:  # as a manifest's missing object: the copy is incomplete
                raise IncompleteCheckpointError(
                    f"{url}/{HF_INDEX} lists shard(s) {missing}, missing from {url}: an "
                    "interrupted or partial copy; copy the checkpoint again"
                )
        elif store.exists(HF_SINGLE):  # the checkpoint, whatever else lies beside it
            files = [HF_SINGLE]
        else:
            files = sorted(n for n in store.listdir() if n.endswith(".safetensors"))
            if any(HF_SHARD.match(f) for f in files):
                raise IncompleteCheckpointError(
                    f"{url} holds hf shards but no {HF_INDEX}: an interrupted or partial copy"
                )
        if not files:
            raise CheckpointNotFoundError(f"no .safetensors file at {url}")
        self._where: dict[str, tuple[str, int, int]] = {}  # name -> (file, data start, byte start)
        try:
            self._read_headers(files, index_map)
        except BaseException:
            store.release()
            raise

    def _read_headers(self, files: list[str], index_map: dict[str, str]) -> None:
        """Every file's header, each file's identity noted first (``Store.hold``): its tensors
        are read later from the file whose header was read here, or not at all."""
        store, url = self.store, self.url
        held: dict[str, str] = {}  # every name in a header (dtype supported or not) -> its file
        for file in files:
            try:
                store.hold(file)
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"safetensors file {store.where(file)} does not exist"
                ) from None
            header, base = read_header(store, file)
            meta = header.pop("__metadata__", None) or {}  # read_header checked: str -> str
            if HF_VALUES_KEY in meta:
                where, what = store.where(file), f"__metadata__[{HF_VALUES_KEY!r}]"
                values = decode_json(meta[HF_VALUES_KEY].encode(), where=where, what=what)
                if not isinstance(values, dict):
                    raise CorruptCheckpointError(
                        f"{where}: {what} holds {show(values)}, not a JSON object of named values"
                    )
                for name, value in values.items():
                    self.keep_value(name, value)
            for name, entry in header.items():  # read_header checked each entry's types
                held.setdefault(name, file)
                if entry["dtype"] not in BY_SAFETENSORS_CODE:
                    self.dropped[name] = f"safetensors dtype {entry['dtype']} unsupported"
                    continue
                info = TensorInfo(name, tuple(entry["shape"]), BY_SAFETENSORS_CODE[entry["dtype"]])
                start, end = entry["data_offsets"]
                if end - start != info.nbytes:
                    raise CorruptCheckpointError(
                        f"safetensors file {store.where(file)}: tensor {name!r} shape "
                        f"{list(info.shape)} {entry['dtype']} needs {info.nbytes} bytes, "
                        f"data_offsets hold {end - start}"
                    )
                if name in self.tensors:
                    raise CorruptCheckpointError(f"tensor {name!r} appears in two files of {url}")
                self.tensors[name] = info
                self._where[name] = (file, base, start)
        self._check_index(index_map, held)

    def _check_index(self, weight_map: dict[str, str], held: dict[str, str]) -> None:
        """CorruptCheckpointError unless every tensor the index's ``weight_map`` names is in the
        shard it names (``held``: each tensor's file): a shard replaced by another file, or an
        edited index, would otherwise load fewer tensors than the index lists."""
        wrong = [(n, f) for n, f in sorted(weight_map.items()) if held.get(n) != f]
        if wrong:
            name, file = wrong[0]
            found = f"it is in {held[name]!r}" if name in held else "no shard it lists holds it"
            raise CorruptCheckpointError(
                f"{self.url}/{HF_INDEX} puts tensor {name!r} in {file!r}, but {found} "
                f"({len(wrong)} tensor(s) of the index disagree with its shards: a shard replaced "
                "by another file, or an edited index); copy or export the checkpoint again"
            )

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        for name, offset, out in requests:
            file, base, start = self._where[name]
            at = base + start + offset * out.element_size()
            self.store.read_into(file, at, tensor_bytes(out))

    def close(self) -> None:
        self.store.release()


class TorchSource(Source):
    """A ``torch.save`` zip file; structure read with ``weights_only=True`` on the meta device."""

    format = "torch"

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        url = store.url
        try:
            store.hold()  # every read below and later is of the file as it is now
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"torch file {url} does not exist") from None
        try:
            self._open(store)
        except BaseException:
            store.release()
            raise

    def _open(self, store: Store) -> None:
        url = store.url
        try:
            with store.open() as f:  # the store is rooted at the file itself
                obj = torch.load(cast(IO[bytes], f), map_location="meta", weights_only=True)
                size = f.length
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
        # the strided tensor read last, contiguous: replaced whole, never changed (each read
        # takes it once, so that threads reading at once each copy from the one they took)
        self._cache: tuple[str, torch.Tensor] | None = None
        self._walk(obj, url)
        with store.open() as f:
            check_torch_storages(cast(IO[bytes], f), size, self._meta.items(), f"torch file {url}")

    def _walk(self, obj: dict, url: str) -> None:
        """Flatten ``obj`` into tensors and JSON values without recursion: into every dict and
        every list or tuple holding a tensor (``layers.0.w``, as ``storage.save`` and DCP name
        them; another is one value). A container at two places is refused: flattened, each place
        would get its own names, 2**depth of them for a list of itself twice, nested."""
        holders = _holding_tensors(obj)
        names: set[str] = set()  # every flat name given (a tensor, a value, or dropped)
        entered = {id(obj): "the top level"}  # each container walked into -> where
        # (prefix, its items not yet seen): depth first, in the order the recursion had
        stack: list[tuple[str, Iterator]] = [("", iter(obj.items()))]
        while stack:
            prefix, items = stack[-1]
            for key, value in items:
                name = f"{prefix}.{key}" if prefix else str(key)
                if isinstance(value, dict) or (
                    isinstance(value, (list, tuple)) and id(value) in holders
                ):
                    if len(stack) >= MAX_JSON_DEPTH:
                        raise CorruptCheckpointError(
                            f"torch file {url}: {show(name)} nests dicts or lists deeper than "
                            f"{MAX_JSON_DEPTH} levels; flatten the state dict"
                        )
                    if id(value) in entered:
                        raise CorruptCheckpointError(
                            f"torch file {url}: one {type(value).__name__} is both "
                            f"{show(entered[id(value)])} and {show(name)}; save a state dict "
                            "whose containers are each at one place (copy.deepcopy the shared one)"
                        )
                    entered[id(value)] = name
                    children = value.items() if isinstance(value, dict) else enumerate(value)
                    stack.append((name, iter(children)))
                    break
                if name in names:
                    raise CorruptCheckpointError(
                        f"torch file {url}: two entries flatten to the same name {show(name)} "
                        "(a dotted key beside nested ones, e.g. 'a.b' and 'a': {'b': ...}); "
                        "rename one of them and save the file again"
                    )
                names.add(name)
                if isinstance(value, torch.Tensor):
                    if value.dtype not in BY_SAFETENSORS_CODE.values():
                        self.dropped[name] = f"dtype {value.dtype} unsupported"
                        continue
                    self._meta[name] = value
                    self.tensors[name] = TensorInfo(name, tuple(value.shape), value.dtype)
                else:
                    self.keep_value(name, value)
            else:
                stack.pop()  # every item seen

    def read_into(self, requests: Sequence[tuple[str, int, torch.Tensor]]) -> None:
        for name, offset, out in requests:
            self._read(name, offset, out)
            meta = self._meta[name]
            # A conjugate or negative view's storage holds the values before the view: torch
            # applies the bit when the tensor is read, and so does this.
            if meta.is_conj():
                torch.conj_physical(out, out=out)
            if meta.is_neg():
                out.neg_()

    def _read(self, name: str, offset: int, out: torch.Tensor) -> None:
        """The stored elements ``offset ...`` of ``name``, as its storage holds them."""
        meta = self._meta[name]
        base = meta.untyped_storage()._checkpoint_offset
        assert base is not None, name  # check_torch_storages found its record
        size = out.element_size()
        if meta.is_contiguous():
            at = base + (int(meta.storage_offset()) + offset) * size
            self.store.read_into("", at, tensor_bytes(out))
            return
        # A strided view is no flat range: read its storage once, keep a contiguous copy.
        cached = self._cache  # taken once: another thread may replace it meanwhile
        if cached is None or cached[0] != name:
            self._cache = cached = None  # freed before the next is read (unless in use)
            raw = torch.empty(meta.untyped_storage().nbytes() // size, dtype=meta.dtype)
            self.store.read_into("", base, tensor_bytes(raw))
            full = raw.as_strided(meta.shape, meta.stride(), meta.storage_offset()).contiguous()
            self._cache = cached = (name, full.view(-1))
        out.copy_(cached[1][offset : offset + out.numel()])

    def close(self) -> None:
        self._cache = None
        self.store.release()
