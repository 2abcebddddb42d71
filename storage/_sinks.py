"""Writers of every output format, streaming from a ``Feed``; each commits last.

- ``ftsdp``: the objects of a ``world_size``-rank layout (each tensor split into ``world_size``
  even flat ranges, as a sharded save would write it), then ``manifest.json`` (the commit), then
  ``latest``.
- ``hf``: safetensors files of at most ``max_shard_bytes`` each (one ``model.safetensors`` when
  everything fits), then ``model.safetensors.index.json`` when there are several.
- ``torch``: one ``torch.save`` file, written under a temporary name and renamed (locally) or
  uploaded whole (object stores).
- ``dcp``: see ``storage/_dcp.py``; ``.metadata`` last.

Every file is written whole or not at all (``atomic_write``), and the commit file comes last, so
an interrupted conversion never leaves a destination that looks complete.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from typing import Any

import torch

from ftsdp.storage._dtypes import dtype_name, safetensors_code
from ftsdp.storage._feed import Feed
from ftsdp.storage._fs import Store
from ftsdp.storage._layout import LATEST, manifest_path, parse_step, step_dir
from ftsdp.storage._manifest import Manifest, Piece, TensorEntry
from ftsdp.storage._options import SaveOptions
from ftsdp.storage._safetensors import crc32
from ftsdp.storage._save_plan import make_plan
from ftsdp.storage._sources import HF_INDEX, HF_SINGLE, SHARD_NAME, VALUES_KEY
from ftsdp.storage._steps import committed_steps, remove_step
from ftsdp.storage._streaming import Request, atomic_write, is_local, tensor_bytes, url_to_fs


class _BlockCrc:
    """CRC-32 per ``block`` bytes of a byte stream fed in arbitrary pieces."""

    def __init__(self, block: int) -> None:
        self.block, self.crcs, self._crc, self._n = block, [], 0, 0

    def update(self, mv: memoryview) -> None:
        pos = 0
        while pos < len(mv):
            take = min(self.block - self._n, len(mv) - pos)
            self._crc = crc32(mv[pos : pos + take], self._crc)
            self._n += take
            pos += take
            if self._n == self.block:
                self.crcs.append(self._crc)
                self._crc, self._n = 0, 0

    def finish(self) -> list[int]:
        if self._n:
            self.crcs.append(self._crc)
        return self.crcs


class FtsdpSink:
    """A checkpoint root in this package's format; writes one step."""

    def __init__(
        self, url: str, storage_options: dict | None, world_size: int, object_bytes: int
    ) -> None:
        self.store = Store(url, storage_options)
        self.world_size, self.options = world_size, SaveOptions(object_bytes=object_bytes)

    def holds_checkpoint(self) -> bool:
        return bool(committed_steps(self.store))  # torn attempts are no checkpoint

    def clear(self) -> None:
        for name in self.store.listdir():
            step = parse_step(name)
            if step is not None:
                remove_step(self.store, step)  # manifest first
        self.store.remove(LATEST)

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int, chunk: int
    ) -> list[str]:
        w = self.world_size
        metas: list[dict[str, Any]] = [{"tensors": []} for _ in range(w)]
        for t in feed.infos:
            per = -(-t.numel // w)
            for r in range(w):
                lo, hi = min(r * per, t.numel), min((r + 1) * per, t.numel)
                if hi > lo or (t.numel == 0 and r == 0):
                    metas[r]["tensors"].append(
                        [t.name, list(t.shape), dtype_name(t.dtype), lo, hi - lo]
                    )
        plan = make_plan(metas, uuid.uuid4().hex[:8], self.options)
        fs, block = self.store.fs, self.options.checksum_block_bytes
        crcs: dict[str, list[list[int]]] = {}
        for obj in plan.objects:
            requests: list[tuple[int, Request]] = []
            for i, p in enumerate(obj.pieces):
                requests.extend((i, r) for r in feed.requests(p.name, p.offset, p.length))
            per_piece = [_BlockCrc(block) for _ in obj.pieces]
            path = self.store.full(f"{step_dir(step)}/{obj.name}")
            with atomic_write(fs, path, chunk) as f:
                f.write(obj.head)
                written = len(obj.head)
                for (i, _), data in zip(
                    requests, feed.stream([r for _, r in requests]), strict=True
                ):
                    mv = tensor_bytes(data)
                    per_piece[i].update(mv)
                    f.write(mv)
                    written += len(mv)
                assert written == obj.size, (obj.name, written, obj.size)
            crcs[obj.name] = [c.finish() for c in per_piece]
        pieces: dict[str, list[Piece]] = {name: [] for name in plan.shapes}
        for obj in plan.objects:
            for p, (start, end), crc in zip(
                obj.pieces, obj.byte_ranges, crcs[obj.name], strict=True
            ):
                pieces[p.name].append(
                    Piece(obj.name, p.key, p.offset, p.length, start, end, tuple(crc))
                )
        manifest = Manifest(
            step=step,
            world_size=w,
            attempt=plan.attempt,
            checksum_block_bytes=block,
            objects={o.name: o.size for o in plan.objects},
            tensors={
                n: TensorEntry(shape, dt, tuple(sorted(pieces[n], key=lambda p: p.offset)))
                for n, (shape, dt) in plan.shapes.items()
            },
            values=values,
            rank_values=[dict(rank_values[r]) if r < len(rank_values) else {} for r in range(w)],
        )
        self.store.write_bytes(manifest_path(step), manifest.to_json())  # the commit
        steps = committed_steps(self.store)
        if steps and steps[-1] == step:
            self.store.write_bytes(LATEST, f"{step}\n".encode())
        return [self.store.where(step_dir(step))]


def _safetensors_head(infos: list, values: dict[str, Any] | None) -> tuple[bytes, int]:
    """Header bytes (8-byte length + JSON padded to 8) and payload size of a safetensors file."""
    meta = {"format": "pt"}
    if values:
        meta[VALUES_KEY] = json.dumps(values, separators=(",", ":"))
    header: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for t in infos:
        header[t.name] = {
            "dtype": safetensors_code(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [pos, pos + t.nbytes],
        }
        pos += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, pos


def _remove_all(sink: HfSink | DcpSink) -> None:
    """Delete the files a sink found at its destination (``--overwrite``)."""
    for p in sink._existing():
        sink.fs.rm(p)
    sink.fs.invalidate_cache(sink.path)


class HfSink:
    """Hugging Face style safetensors: one file, or shards plus ``model.safetensors.index.json``."""

    def __init__(self, url: str, storage_options: dict | None, max_shard_bytes: int | None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.path = url_to_fs(url, storage_options)
        self.single_file = self.path.endswith(".safetensors")
        self.max_shard_bytes = max_shard_bytes

    def _existing(self) -> list[str]:
        if self.single_file:
            return [self.path] if self.fs.exists(self.path) else []
        if not self.fs.isdir(self.path):
            return []
        names = [
            p for p in self.fs.ls(self.path, detail=False) if p.endswith((".safetensors", HF_INDEX))
        ]
        return sorted(names, key=lambda p: not p.endswith(HF_INDEX))  # the index first

    def holds_checkpoint(self) -> bool:
        """A single file, or a directory with an index or ``model.safetensors``; shards without
        an index are what an interrupted write leaves (removed before writing)."""
        self.fs.invalidate_cache(self.path)
        if self.single_file:
            return self.fs.exists(self.path)
        return any(p.endswith(("/" + HF_INDEX, "/" + HF_SINGLE)) for p in self._existing())

    def clear(self) -> None:
        _remove_all(self)

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int, chunk: int
    ) -> list[str]:
        infos = sorted(feed.infos, key=lambda t: t.name)
        shards: list[list] = [[]]
        used = 0
        for t in infos:
            if self.max_shard_bytes and shards[-1] and used + t.nbytes > self.max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(t)
            used += t.nbytes
        if len(shards) > 1 and self.single_file:
            raise ValueError(
                f"{self.url}: a single .safetensors file cannot be split into {len(shards)} shards; "
                "give a directory as destination or drop --max-shard-size"
            )
        n = len(shards)
        names = (
            [HF_SINGLE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        paths = [self.path] if self.single_file else [f"{self.path}/{name}" for name in names]
        if not self.single_file and is_local(self.fs):
            os.makedirs(self.path, exist_ok=True)
        for p in self._existing():  # leftovers of an interrupted write (no index: not a checkpoint)
            if SHARD_NAME.match(p.rsplit("/", 1)[-1]):
                self.fs.rm(p)
        for i, (shard, path) in enumerate(zip(shards, paths, strict=True)):
            head, _ = _safetensors_head(shard, values if i == 0 else None)
            requests = [r for t in shard for r in feed.requests(t.name, 0, t.numel)]
            with atomic_write(self.fs, path, chunk) as f:
                f.write(head)
                for data in feed.stream(requests):
                    f.write(tensor_bytes(data))
        if n == 1:
            return [f"{self.url}/{names[0]}" if not self.single_file else self.url]
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in infos)},
            "weight_map": {t.name: names[i] for i, shard in enumerate(shards) for t in shard},
        }
        with atomic_write(self.fs, f"{self.path}/{HF_INDEX}") as f:  # the commit
            f.write(json.dumps(index, indent=2, sort_keys=True).encode())
        return [f"{self.url}/{HF_INDEX}", *(f"{self.url}/{name}" for name in names)]


class TorchSink:
    """One ``torch.save`` file of the flat state dict (tensors and values by dotted name).

    [Note: a torch file without holding its tensors] ``torch.save`` under
    ``torch.serialization.skip_data()`` writes the file's structure with uninitialised tensors
    (``torch.empty``: address space, not resident memory) and leaves room for their bytes; loading
    that skeleton on the meta device gives each storage's byte offset, where the feed's chunks are
    then written in place.
    """

    def __init__(self, url: str, storage_options: dict | None) -> None:
        self.url = url
        self.fs, self.path = url_to_fs(url, storage_options)

    def holds_checkpoint(self) -> bool:
        self.fs.invalidate_cache(self.path)
        if self.fs.isdir(self.path):
            raise IsADirectoryError(f"{self.url} is a directory; the torch format writes one file")
        return self.fs.exists(self.path)

    def clear(self) -> None:
        """Nothing: the new file replaces the old one whole."""

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int, chunk: int
    ) -> list[str]:
        infos = feed.infos
        skeleton: dict[str, Any] = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in infos}
        skeleton.update((k, v) for k, v in values.items() if k not in skeleton)
        local = is_local(self.fs)
        folder = os.path.dirname(self.path) if local else None
        if folder:
            os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ftsdp-ckpt-", suffix=".pt.tmp", dir=folder)
        os.close(fd)
        try:
            with torch.serialization.skip_data():
                torch.save(skeleton, tmp)
            del skeleton
            with open(tmp, "rb") as f:
                meta = torch.load(f, map_location="meta", weights_only=True)
            with open(tmp, "r+b") as f:
                for t in sorted(
                    infos, key=lambda t: meta[t.name].untyped_storage()._checkpoint_offset
                ):
                    f.seek(meta[t.name].untyped_storage()._checkpoint_offset)
                    for data in feed.stream(feed.requests(t.name, 0, t.numel)):
                        f.write(tensor_bytes(data))
                f.flush()
                os.fsync(f.fileno())
            if local:
                os.replace(tmp, self.path)
            else:
                self.fs.put_file(tmp, self.path)  # one upload, completed only when whole
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return [self.url]


class DcpSink:
    """A ``torch.distributed.checkpoint`` directory (see ``storage/_dcp.py``)."""

    def __init__(self, url: str, storage_options: dict | None) -> None:
        self.url, self.options = url, storage_options
        self.fs, self.path = url_to_fs(url, storage_options)

    def _existing(self) -> list[str]:
        self.fs.invalidate_cache(self.path)
        if not self.fs.isdir(self.path):
            return []
        names = [
            p for p in self.fs.ls(self.path, detail=False) if p.endswith((".metadata", ".distcp"))
        ]
        return sorted(names, key=lambda p: not p.endswith(".metadata"))  # the commit first

    def holds_checkpoint(self) -> bool:
        return any(p.endswith(".metadata") for p in self._existing())  # DCP's commit

    def clear(self) -> None:
        _remove_all(self)

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int, chunk: int
    ) -> list[str]:
        from ftsdp.storage._dcp import write_dcp

        write_dcp(self.url, self.options, feed.infos, values, feed.block, chunk)
        return [self.url]


def make_sink(
    fmt: str,
    url: str,
    storage_options: dict | None,
    *,
    world_size: int | None,
    max_shard_bytes: int | None,
    object_bytes: int,
) -> Any:
    """The writer of format ``fmt`` at ``url``."""
    if fmt == "ftsdp":
        return FtsdpSink(url, storage_options, world_size or 1, object_bytes)
    if fmt == "hf":
        return HfSink(url, storage_options, max_shard_bytes)
    if fmt == "torch":
        return TorchSink(url, storage_options)
    if fmt == "dcp":
        return DcpSink(url, storage_options)
    raise ValueError(f"unknown format {fmt!r}")
