"""Writers of the ``ftsdp``, ``hf`` and ``torch`` formats, streaming from a ``Feed`` (``dcp``:
``_dcp.py``). [Note: a sink deletes only what it wrote]: a folder sink records the files it will
write in ``PENDING`` until its commit and takes only names of its own scheme from that record
(docs/cli.md, "Threat model")."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import MAX_MANIFEST_BYTES, SaveOptions
from ftsdp.storage.conversion._interfaces import Feed, Sink
from ftsdp.storage.conversion._mesh import PlacementRules, mesh_layout, placements_for
from ftsdp.storage.format._dtypes import dtype_name
from ftsdp.storage.format._layout import (
    HF_INDEX,
    HF_SHARD,
    HF_SINGLE,
    HF_VALUES_KEY,
    LATEST,
    manifest_path,
    parse_step,
    step_dir,
)
from ftsdp.storage.format._manifest import Manifest
from ftsdp.storage.format._objects import PlannedObject
from ftsdp.storage.format._safetensors import layout, write_object
from ftsdp.storage.format._steps import committed_steps, remove_attempt, remove_step
from ftsdp.storage.io._fs import Store, is_plain_name
from ftsdp.storage.io._streaming import TensorInfo, tensor_bytes
from ftsdp.storage.saving._commit import build_manifest, commit, new_attempt
from ftsdp.storage.saving._save_plan import make_plan


class FtsdpSink(Sink):
    """An ftsdp checkpoint root; writes one step laid out for ``world_size`` ranks (even flat
    ranges), or as the ranks of ``mesh`` hold DTensors of the placements ``rules`` give
    (``_mesh.py``: the boxes of a grid)."""

    def __init__(
        self,
        store: Store,
        world_size: int,
        object_bytes: int,
        mesh: tuple[int, ...] | None = None,
        rules: PlacementRules = (),
    ) -> None:
        super().__init__(store)
        self.world_size = world_size if mesh is None else math.prod(mesh)
        self.options = SaveOptions(object_bytes=object_bytes)
        self.mesh, self.rules = mesh, rules

    def holds_checkpoint(self) -> bool:
        return bool(committed_steps(self.store))  # torn attempts are no checkpoint

    def clear(self) -> None:
        for name in self.store.listdir():
            step = parse_step(name)
            if step is not None:
                remove_step(self.store, step)  # manifest first
        self.store.remove(LATEST)

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int
    ) -> list[str]:
        w = self.world_size
        metas: list[dict[str, Any]] = [{"tensors": []} for _ in range(w)]
        for t in feed.infos:
            if self.mesh is not None:
                self._mesh_ranges(feed, t, metas)
                continue
            per = -(-t.numel // w)
            for r in range(w):
                lo, hi = min(r * per, t.numel), min((r + 1) * per, t.numel)
                if hi > lo or (t.numel == 0 and r == 0):
                    metas[r]["tensors"].append(
                        [t.name, list(t.shape), dtype_name(t.dtype), lo, hi - lo]
                    )
        attempt = new_attempt(self.store, step)
        plan = make_plan(metas, attempt, self.options)
        try:
            crcs = {obj.name: self._write_object(feed, step, obj) for obj in plan.objects}
            manifest = build_manifest(
                plan,
                crcs,
                step=step,
                world_size=w,
                checksum_block_bytes=self.options.checksum_block_bytes,
                values=values,
                rank_values=rank_values,
            )
            # The reader's checks first: a step committed is one load, inspect and verify accept.
            where = self.store.where(manifest_path(step))
            try:
                Manifest.from_json(manifest.to_json(), where=where)
            except CheckpointError as e:
                raise ValueError(f"not committed, a reader would refuse it: {e}") from None
        except BaseException:
            # Only this attempt's objects; a failed removal is left to gc, the first error raised.
            with contextlib.suppress(Exception):
                remove_attempt(self.store, step, attempt)
            raise
        commit(self.store, manifest)
        return [self.store.where(step_dir(step))]

    def _mesh_ranges(self, feed: Feed, t: TensorInfo, metas: list[dict[str, Any]]) -> None:
        """List ``t`` in each rank's meta as that rank of the mesh holds it: the range of its
        box in the grid order, the grid as the sixth item; the feed serves that order."""
        assert self.mesh is not None
        placements = placements_for(t.name, len(t.shape), self.mesh, self.rules)
        grid, ranges = mesh_layout(tuple(t.shape), self.mesh, placements)
        if grid is not None:
            feed.set_grid(t.name, grid)
        for r, rng in enumerate(ranges):
            if rng is not None:
                entry = [t.name, list(t.shape), dtype_name(t.dtype), rng.offset, rng.length]
                metas[r]["tensors"].append([*entry, [list(c) for c in grid]] if grid else entry)

    def _write_object(self, feed: Feed, step: int, obj: PlannedObject) -> list[list[int]]:
        """Write one data object from the feed; its pieces' checksums."""
        crcs: list[list[int]] = []

        def produce(f: IO[bytes]) -> None:
            requests = [
                (i, r)
                for i, p in enumerate(obj.pieces)
                for r in feed.requests(p.name, p.offset, p.length)
            ]
            data = feed.stream([r for _, r in requests])
            chunks = zip([i for i, _ in requests], data, strict=True)
            block = self.options.checksum_block_bytes
            crcs[:] = write_object(f, obj.head, len(obj.pieces), chunks, block)
            if f.tell() != obj.size:  # the plan's byte layout is what the manifest will say
                raise AssertionError(f"{obj.name}: wrote {f.tell()} bytes, planned {obj.size}")

        self.store.write(f"{step_dir(step)}/{obj.name}", produce)
        return crcs


PENDING = ".ftsdp-writing.json"  # the files a write in progress writes (see the note)


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux's ``/proc``); None: unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22: after the name
    except (OSError, ValueError, IndexError):
        return None


def _running_here(host: Any, pid: Any, started: Any) -> bool:
    """Whether process ``pid`` of ``host``, started at ``started``, is another process running
    on this machine (a process that reused the number started later)."""
    if host != socket.gethostname() or type(pid) is not int or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    now = _started(pid)
    return now is None or started is None or now == started


DCP_ITEM = re.compile(r"__\d+_\d+\.distcp")  # what our DCP writer names its files


class Pending:
    """A folder sink's record of its write in progress; only names ``scheme`` matches count.
    The record names its writer (a token, the host and the process): a record of a process
    still running on this host is a live write, not an interrupted one, and a write whose
    record another writer took over does not commit."""

    def __init__(self, store: Store, scheme: re.Pattern) -> None:
        self.store, self.scheme = store, scheme
        self.leftovers: list[str] = []
        self.recorded = False
        self.token = uuid.uuid4().hex

    def _record(self) -> dict[str, Any] | None:
        """The record there ({} when there is none; None when it is not one of ours)."""
        try:
            record = json.loads(self.store.read_bounded(PENDING, MAX_MANIFEST_BYTES))
        except FileNotFoundError:
            return {}
        except ValueError:
            return None
        files = record.get("files") if isinstance(record, dict) else None
        return record if isinstance(files, list) else None

    def _earlier(self) -> list[str] | None:
        """The files an interrupted write recorded; None when the record is not ours.
        FileExistsError when the write that recorded them is running on this host."""
        record = self._record()
        if not record:
            return None if record is None else []
        owner = record.get("owner")
        owner = owner if isinstance(owner, dict) else {}
        pid = owner.get("pid")
        if _running_here(owner.get("host"), pid, owner.get("started")):
            raise FileExistsError(
                f"{self.store.url}: another write into it is running (process {pid} on "
                f"this machine); wait for it to end, or give another destination (if no such "
                f"write runs, remove {PENDING} there)"
            )
        self.recorded = True
        return [f for f in record["files"] if is_plain_name(f) and self.scheme.fullmatch(f)]

    def check(self) -> None:
        """Before the commit: CheckpointError when another write took the record over (its
        files then replace this write's: this one must not commit over them)."""
        if not self.recorded:
            return
        record = self._record()
        owner = (record or {}).get("owner")
        if not isinstance(owner, dict) or owner.get("token") != self.token:
            raise CheckpointError(
                f"{self.store.url}: another write into it started while this one ran and took "
                "it over; this one stops before its commit (the other's result is the one kept)"
            )

    def claim(self, names: list[str], overwrite: bool, record: bool = True) -> None:
        """Before writing the files ``names``: FileExistsError for one that exists and is not
        the sink's own unless ``overwrite``; then record ``names`` (unless not ``record``: a
        single file that is its own commit leaves nothing behind when interrupted)."""
        listing = self.store.listdir()
        earlier = self._earlier()
        foreign = sorted(n for n in names if n in listing and n not in (earlier or ()))
        if earlier is None and PENDING in listing:
            foreign.append(PENDING)
        if foreign and not overwrite:
            raise FileExistsError(
                f"{self.store.url} already holds {foreign}, which this tool did not write; pass "
                "overwrite (--overwrite) to replace them"
            )
        earlier = earlier or []
        self.leftovers = [n for n in earlier if n not in names and n in listing]
        if record:
            files = sorted(set(names) | set(earlier))
            pid = os.getpid()
            owner = {
                "token": self.token,
                "host": socket.gethostname(),
                "pid": pid,
                "started": _started(pid),
            }
            self.store.write_bytes(PENDING, json.dumps({"files": files, "owner": owner}).encode())
            self.recorded = True

    def release(self) -> None:
        """After the commit: delete an interrupted write's leftovers, then the record."""
        for name in self.leftovers:
            self.store.remove(name)
        if self.recorded:
            self.store.remove(PENDING)


class HfSink(Sink):
    """Hugging Face style safetensors: one file, or shards plus ``model.safetensors.index.json``.
    ``extra``: (plain name, produce) of files written before the tensors; no commit file lists
    them, so ``overwrite`` replaces them but never deletes them."""

    def __init__(
        self,
        store: Store,
        max_shard_bytes: int | None,
        overwrite: bool = False,
        extra: Sequence[tuple[str, Callable[[IO[bytes]], None]]] = (),
    ) -> None:
        super().__init__(store)
        self.single_file = store.url.endswith(".safetensors")  # the store is rooted at the file
        self.max_shard_bytes, self.overwrite = max_shard_bytes, overwrite
        self.extra = list(extra)  # convert refuses them for a single file

    def _indexed(self) -> list[str]:
        """The plain file names the index there lists ([] when it is unreadable)."""
        try:
            weight_map = json.loads(self.store.read_bounded(HF_INDEX, MAX_MANIFEST_BYTES))[
                "weight_map"
            ]
            files = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        return sorted(f for f in files if is_plain_name(f) and f != HF_INDEX)

    def existing(self) -> list[str]:
        """The checkpoint there: the index first, then the files it lists, or the single file."""
        if self.single_file or not self.store.isdir():
            return []
        listing = self.store.listdir()
        out = [HF_INDEX, *self._indexed()] if HF_INDEX in listing else []
        out += [HF_SINGLE] if HF_SINGLE not in out else []
        return [n for n in out if n in listing]

    def holds_checkpoint(self) -> bool:
        """A single file, or a directory with an index or ``model.safetensors``; shards without
        an index are what an interrupted write leaves."""
        return self.store.exists() if self.single_file else super().holds_checkpoint()

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int
    ) -> list[str]:
        infos = sorted(feed.infos, key=lambda t: t.name)
        if any(t.name == "__metadata__" for t in infos):  # checked before anything is written
            raise ValueError(
                f"{self.store.url}: a tensor named '__metadata__' cannot be written to "
                "safetensors, whose header keeps its metadata under that key; rename it "
                "(--rename __metadata__=NEW)"
            )
        shards: list[list] = [[]]
        used = 0
        for t in infos:
            if self.max_shard_bytes and shards[-1] and used + t.nbytes > self.max_shard_bytes:
                shards.append([])
                used = 0
            shards[-1].append(t)
            used += t.nbytes
        url, n = self.store.url, len(shards)
        if n > 1 and self.single_file:
            raise ValueError(
                f"{url}: a single .safetensors file cannot be split into {n} shards; "
                "give a directory as destination or drop --max-shard-size"
            )
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        names = names if n > 1 else [HF_SINGLE]
        extra_names = [name for name, _ in self.extra]
        if not self.single_file:  # extra files are the write's own too; a lone model.safetensors
            # is its own commit, recorded only with extra files
            scheme = re.compile("|".join([HF_SHARD.pattern, *map(re.escape, extra_names)]))
            pending = Pending(self.store, scheme)
            pending.claim([*extra_names, *names], self.overwrite, record=n > 1 or bool(extra_names))
        for name, produce_extra in self.extra:  # before the tensors: a complete look has them
            self.store.write(name, produce_extra)
        meta = [{"format": "pt"} for _ in shards]  # the first file also holds the values
        if values:
            meta[0][HF_VALUES_KEY] = json.dumps(values, separators=(",", ":"))
        for i, (shard, name) in enumerate(zip(shards, names, strict=True)):
            head = layout([(t.name, t.dtype, t.shape) for t in shard], meta[i])[0]
            requests = [r for t in shard for r in feed.requests(t.name, 0, t.numel)]

            def produce(f: IO[bytes], head: bytes = head, requests: list = requests) -> None:
                f.write(head)
                for data in feed.stream(requests):
                    f.write(tensor_bytes(data))

            if n == 1 and not self.single_file:  # model.safetensors is the commit
                pending.check()
            self.store.write("" if self.single_file else name, produce)
        if self.single_file:
            return [url]
        if n > 1:
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in infos)},
                "weight_map": {t.name: names[i] for i, shard in enumerate(shards) for t in shard},
            }
            pending.check()
            self.store.write_bytes(HF_INDEX, json.dumps(index, indent=2, sort_keys=True).encode())
        pending.release()
        written = names if n == 1 else [HF_INDEX, *names]
        return [f"{url}/{name}" for name in [*written, *extra_names]]


class TorchSink(Sink):
    """One ``torch.save`` file of the flat state dict, streamed: a skeleton written by
    ``torch.save`` under ``skip_data()`` gives each storage's offset, and the file is its bytes
    with each storage's from the feed (docs/cli.md, "Memory")."""

    def holds_checkpoint(self) -> bool:
        if self.store.isdir():
            raise IsADirectoryError(
                f"{self.store.url} is a directory; the torch format writes one file"
            )
        return self.store.exists()

    def write(
        self, feed: Feed, values: dict[str, Any], rank_values: list[dict], step: int
    ) -> list[str]:
        infos = feed.infos
        skeleton: dict[str, Any] = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in infos}
        skeleton.update((k, v) for k, v in values.items() if k not in skeleton)
        # Local scratch: torch.save needs a real file to seek over the tensors' bytes.
        fd, scratch = tempfile.mkstemp(prefix=".ftsdp-ckpt-", suffix=".pt.skeleton")
        os.close(fd)
        try:
            with torch.serialization.skip_data():
                torch.save(skeleton, scratch)
            del skeleton
            with open(scratch, "rb") as f:
                meta = torch.load(f, map_location="meta", weights_only=True)
            at = {t.name: meta[t.name].untyped_storage()._checkpoint_offset for t in infos}
            del meta

            def produce(out: IO[bytes]) -> None:
                with open(scratch, "rb") as skel:
                    for t in sorted(infos, key=lambda t: at[t.name]):
                        _copy(skel, out, at[t.name] - skel.tell())  # the structure before it
                        for data in feed.stream(feed.requests(t.name, 0, t.numel)):
                            out.write(tensor_bytes(data))
                        skel.seek(t.nbytes, os.SEEK_CUR)
                    shutil.copyfileobj(skel, out)  # the rest: the zip directory

            self.store.write("", produce)  # the store is rooted at the file itself
        finally:
            os.remove(scratch)
        return [self.store.url]


def _copy(src: IO[bytes], dst: IO[bytes], n: int) -> None:
    """Copy ``n`` bytes of ``src`` to ``dst``, a MiB at a time."""
    while n > 0:
        data = src.read(min(n, 1 << 20))
        if not data:
            raise OSError("the torch.save skeleton is shorter than its offsets say")
        dst.write(data)
        n -= len(data)
