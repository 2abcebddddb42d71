"""Per-rank work of ``tools/bench_checkpoint.py``: the FSDP-like state and the timed phases.

[Note: which DCP path the benchmark uses]
The state is what FSDP2 hands to checkpointing: every parameter and every AdamW moment is a
DTensor ``Shard(0)`` over a 1-D device mesh (gloo, CPU), ``step`` a plain 0-dim tensor. That is the
idiomatic input of ``torch.distributed.checkpoint`` (``dcp.save(state, checkpoint_id=dir)`` with
its default ``FileSystemWriter``; FSDP1's flat ``ShardedTensor`` path through ``torch.distributed
._shard`` is deprecated). ``storage`` takes the very same objects (a ``Shard(0)`` chunk is a flat
range), so both libraries save identical state. Resharding loads build the targets as DTensors
``Shard(0)`` over a mesh of another size and let each library fill them in place.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ftsdp import storage

# -- the state ------------------------------------------------------------------------------------


def shapes(total_bytes: int, dim: int) -> dict[str, tuple[int, ...]]:
    """GPT-like parameter shapes whose model + AdamW state holds at least ``total_bytes``."""
    out: dict[str, tuple[int, ...]] = {"embed.weight": (8 * dim, dim)}

    def state_bytes() -> int:
        return sum(math.prod(s) for s in out.values()) * 4 * 3  # fp32 param, exp_avg, exp_avg_sq

    layer = 0
    while state_bytes() < total_bytes:
        p = f"layers.{layer}."
        out[p + "attn.qkv.weight"] = (3 * dim, dim)
        out[p + "attn.proj.weight"] = (dim, dim)
        out[p + "mlp.fc1.weight"] = (4 * dim, dim)
        out[p + "mlp.fc2.weight"] = (dim, 4 * dim)
        out[p + "ln1.weight"] = (dim,)
        out[p + "ln2.weight"] = (dim,)
        layer += 1
    return out


def _pattern(seed: int, start: int, n: int) -> torch.Tensor:
    """Deterministic fp32 values of global flat elements ``[start, start + n)`` (1-D)."""
    out = torch.empty(n, dtype=torch.float32)
    chunk = 1 << 22
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        idx = torch.arange(start + a, start + b, dtype=torch.int64)
        out[a:b] = ((idx * 40503 + seed * 977) % 65521).to(torch.float32)
    return out


def _sharded(full_shape: tuple[int, ...], mesh: Any, seed: int | None) -> Any:
    """A DTensor ``Shard(0)`` over ``mesh``: pattern values (``seed``) or zeros (``None``)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(full_shape, mesh, [Shard(0)])
    numel = math.prod(local_shape)
    row = math.prod(full_shape[1:])
    if seed is None:
        local = torch.zeros(local_shape)
    else:
        local = _pattern(seed, offsets[0] * row, numel).view(local_shape)
    stride = tuple(math.prod(full_shape[i + 1 :]) for i in range(len(full_shape)))
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size(full_shape), stride=stride
    )


def make_state(shape_map: dict[str, tuple[int, ...]], mesh: Any, fill: bool) -> dict[str, Any]:
    """FSDP2-style model + AdamW state dict (``fill=False``: zeros, a load target)."""
    model, optim = {}, {}
    for i, (name, shape) in enumerate(shape_map.items()):
        model[name] = _sharded(shape, mesh, 3 * i if fill else None)
        optim[name] = {
            "step": torch.tensor(7.0 if fill else 0.0),
            "exp_avg": _sharded(shape, mesh, 3 * i + 1 if fill else None),
            "exp_avg_sq": _sharded(shape, mesh, 3 * i + 2 if fill else None),
        }
    groups = [{"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1, "params": list(shape_map)}]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}}


def check_state(state: dict[str, Any]) -> None:
    """Raise unless every local shard holds the pattern its global position should hold."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for i, (name, dt) in enumerate(state["model"].items()):
        moments = state["optim"]["state"][name]
        assert moments["step"].item() == 7.0, f"{name}: step {moments['step'].item()}"
        for seed, t in (
            (3 * i, dt),
            (3 * i + 1, moments["exp_avg"]),
            (3 * i + 2, moments["exp_avg_sq"]),
        ):
            shape, offsets = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            want = _pattern(seed, offsets[0] * math.prod(t.shape[1:]), math.prod(shape))
            if not torch.equal(t.to_local().reshape(-1), want):
                raise AssertionError(f"{name} (seed {seed}): loaded values differ")


def state_bytes(shape_map: dict[str, tuple[int, ...]]) -> int:
    """Bytes of tensor data in the whole (all ranks) state."""
    return sum(math.prod(s) for s in shape_map.values()) * 4 * 3 + 4 * len(shape_map)


# -- helpers ----------------------------------------------------------------------------------------


def drop_cache(path: str) -> None:
    """Evict a file or every file under a directory from the page cache (clean pages only:
    the raw write and both libraries fsync what they write)."""
    files = [path] if os.path.isfile(path) else []
    for root, _, names in os.walk(path):
        files.extend(os.path.join(root, n) for n in names)
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _disk_read() -> int:
    """Bytes this process (all threads) has caused to be read from the block device so far:
    page-cache misses, by read() and by memory maps alike."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def dcp_bytes_read(path: str, state: dict[str, Any]) -> int:
    """Bytes DCP's FileSystemReader reads for this rank's targets: every saved chunk that
    overlaps a target shard is read whole (then narrowed), per its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    total = 0
    for key, t, shape, offsets in _rank_shards(state):
        md = meta[key]
        assert isinstance(md, TensorStorageMetadata), key  # every key here is a tensor's
        for chunk in md.chunks:
            if all(
                o < co + cs and co < o + s
                for o, s, co, cs in zip(offsets, shape, chunk.offsets, chunk.sizes, strict=True)
            ):
                total += math.prod(chunk.sizes) * t.element_size()
    return total


def _rank_shards(state: dict[str, Any]) -> Iterator[tuple[str, Any, tuple, tuple]]:
    """``(saved key, DTensor, local shape, global offsets)`` of every tensor of the benchmark's
    state (each parameter and its two AdamW moments) on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, dt in state["model"].items():
        moments = state["optim"]["state"][name]
        for key, t in (
            (f"model.{name}", dt),
            (f"optim.state.{name}.exp_avg", moments["exp_avg"]),
            (f"optim.state.{name}.exp_avg_sq", moments["exp_avg_sq"]),
        ):
            shape, offsets = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            yield key, t, tuple(shape), tuple(offsets)


def _timed(fn: Callable[[], Any], evict: str | None = None) -> tuple[float, Any]:
    """Barrier, (rank 0 evicts ``evict`` from the cache), barrier, run ``fn`` on every rank,
    barrier: the wall time of the slowest rank and ``fn``'s result."""
    if evict is not None and dist.get_rank() == 0:
        drop_cache(evict)
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def raw_disk(directory: str, nbytes: int) -> tuple[float, float]:
    """GB/s of a sequential write of ``nbytes`` (8 MiB writes, then fsync) and of reading it
    back after dropping it from the page cache."""
    chunk = 8 << 20
    buf = memoryview(os.urandom(chunk))
    path = os.path.join(directory, "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for off in range(0, nbytes, chunk):
            f.write(buf[: min(chunk, nbytes - off)])
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0) / 1e9
    drop_cache(path)
    into = bytearray(chunk)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(into):
            pass
    read = nbytes / (time.perf_counter() - t0) / 1e9
    os.remove(path)
    return write, read


# -- phases ----------------------------------------------------------------------------------------


def save_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Save the state repeatedly with each backend (sync and async); times of the slowest rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    async_group = dist.new_group(backend="gloo")  # DCP's background save gets its own group
    state = make_state(cfg["shapes"], mesh, fill=True)
    root = cfg["root"]
    out: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    def storage_async(step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        # a root of its own: one timeline each (a save behind a newer committed step is refused)
        h = storage.save(state, f"{root}/storage-async", step, async_save=True, defer_copy=True)
        blocking = time.perf_counter() - t0
        h.wait()
        return blocking, h.blocking_seconds

    def dcp_async(path: str) -> float:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path, process_group=async_group)
        blocking = time.perf_counter() - t0
        assert isinstance(fut, Future)  # without an async stager: one future
        fut.result()
        return blocking

    # What a training job does once before its first save (CheckpointManager.resume does it):
    # storage's own process group and the snapshot memory of the deferred saves.
    t0 = time.perf_counter()
    storage.saving.prepare_save(state, f"{root}/storage-async")
    record("storage.prepare_s", _max(time.perf_counter() - t0))
    for rep in range(cfg["repeats"]):
        dist.barrier()
        if rank == 0:  # the ceiling, measured between the libraries' runs while the others wait
            write, read = raw_disk(root, cfg["bytes"])
            record("raw.write", write)
            record("raw.read", read)
        order = ["storage", "dcp"] if rep % 2 == 0 else ["dcp", "storage"]
        for lib in order:
            if lib == "storage" and "storage" in cfg["backends"]:
                dt, _ = _timed(partial(storage.save, state, f"{root}/storage", 100 + rep))
                record("storage.save_s", dt)
                dt, (blocking, _) = _timed(partial(storage_async, 200 + rep))
                record("storage.async_total_s", dt)
                record("storage.async_blocking_s", _max(blocking))
            if lib == "dcp" and "dcp" in cfg["backends"]:
                dt, _ = _timed(partial(dcp.save, state, checkpoint_id=f"{root}/dcp/save-{rep}"))
                record("dcp.save_s", dt)
                dt, blocking = _timed(partial(dcp_async, f"{root}/dcp/async-{rep}"))
                record("dcp.async_total_s", dt)
                record("dcp.async_blocking_s", _max(blocking))
    return out


def load_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Load the checkpoints saved by ``save_phase`` into a ``world``-rank layout, cache dropped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    target = make_state(cfg["shapes"], mesh, fill=False)
    root = cfg["root"]
    last = cfg["repeats"] - 1
    out: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    def storage_load(url: str, step: int, opts: dict | None) -> tuple[int, int | None, int]:
        before = _disk_read()
        res = storage.load(target, url, step, storage_options=opts)
        return _disk_read() - before, res.bytes_read, res.bytes_needed

    def dcp_load(path: str) -> tuple[int, int | None, int]:
        before = _disk_read()
        dcp.load(target, checkpoint_id=path)
        return _disk_read() - before, None, needed  # bytes read: computed outside the timing

    needed = sum(t.to_local().numel() * 4 for t in target["model"].values()) * 3  # this rank
    runs: list[tuple[str, Callable[[], Any], str | None]] = []
    if "storage" in cfg["backends"]:
        st_root = f"{root}/storage"
        runs.append(("storage", partial(storage_load, st_root, 100 + last, None), st_root))
    if "dcp" in cfg["backends"]:
        dcp_dir = f"{root}/dcp/save-{last}"
        runs.append(("dcp", partial(dcp_load, dcp_dir), dcp_dir))
    for rep in range(cfg["repeats"]):
        for lib, fn, evict in runs if rep % 2 == 0 else runs[::-1]:
            dt, (disk, logical, want) = _timed(fn, evict)
            record(f"{lib}.load_s", dt)
            if evict is not None:  # again, its files now in the page cache
                record(f"{lib}.warm_load_s", _timed(fn)[0])
            if rep == 0:
                check_state(target)
                if logical is None:  # DCP: from its metadata, not inside the timed load
                    assert evict is not None  # DCP's directory
                    logical = dcp_bytes_read(evict, target)
                record(f"{lib}.read_ratio", _sum(logical) / _sum(want))
                if evict is not None:
                    record(f"{lib}.disk_ratio", _sum(disk) / _sum(want))
            _zero(target)
    return out


def _zero(state: dict[str, Any]) -> None:
    for moments in state["optim"]["state"].values():
        moments["exp_avg"].to_local().zero_()
        moments["exp_avg_sq"].to_local().zero_()
        moments["step"].zero_()
    for t in state["model"].values():
        t.to_local().zero_()


# -- S3 (SeaweedFS): the raw s3fs ceiling, storage, and DCP's fsspec writer and reader -------------
#
# Every round runs the three contenders one after the other, the order rotating by one per round,
# each timed barrier to barrier; a warm-up of each comes first, so that no contender pays for a
# fresh client. GB/s: the bytes each wrote or read (all ranks) over the slowest rank's time.

S3_CONTENDERS = ("raw", "storage", "dcp")


def _rotated(rnd: int) -> tuple[str, ...]:
    k = rnd % len(S3_CONTENDERS)
    return S3_CONTENDERS[k:] + S3_CONTENDERS[:k]


def s3_save_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Save to S3 each round with storage, with DCP's ``FsspecWriter``, and put with s3fs the bytes
    of this rank's storage objects as as many objects, all at once (``S3FileSystem.pipe``)."""
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state = make_state(cfg["shapes"], mesh, fill=True)
    s3 = cfg["s3"]
    opts, bucket = s3["options"], s3["bucket"]
    fs = s3fs.S3FileSystem(**opts)
    storage.save(state, s3["url"], 90, storage_options=opts)  # warm-up; its objects' sizes
    mine = [p for p in fs.find(f"{bucket}/ckpt/step-90") if f"/rank{rank:05d}-" in p]
    blobs = [os.urandom(fs.size(p)) for p in mine]
    nbytes = sum(len(b) for b in blobs)
    out: dict[str, list[float]] = {}

    def run(lib: str, tag: str, step: int) -> float:
        if lib == "raw":
            fn = partial(
                fs.pipe, {f"{bucket}/raw-{tag}/{rank}-{i}": b for i, b in enumerate(blobs)}
            )
        elif lib == "storage":
            fn = partial(storage.save, state, s3["url"], step, storage_options=opts)
        else:
            writer = FsspecWriter(f"s3://{bucket}/dcp-{tag}", **opts)
            fn = partial(dcp.save, state, storage_writer=writer)
        return _timed(fn)[0]

    for lib in S3_CONTENDERS:
        run(lib, "warm", 91)
    total = {"raw": _sum(nbytes), "storage": cfg["bytes"], "dcp": cfg["bytes"]}
    for rnd in range(cfg["rounds"]):
        for lib in _rotated(rnd):
            dt = run(lib, str(rnd), 100 + rnd)
            out.setdefault(f"{lib}.save_gbps", []).append(total[lib] / dt / 1e9)
    return out


def _needed_ranges(state: dict[str, Any], manifest: Any, part: int) -> list[tuple[str, int, int]]:
    """``(object, start, end)``: the bytes of the saved objects holding this rank's elements of
    every tensor (from the manifest's pieces), adjacent ones merged, cut into ``part`` bytes."""
    wanted: list[tuple[str, int, int]] = []
    for key, t, shape, offsets in _rank_shards(state):
        lo = offsets[0] * math.prod(t.shape[1:])
        hi = lo + math.prod(shape)
        for p in manifest.tensors[key].pieces_in(lo, hi):
            a, b = max(lo, p.offset), min(hi, p.offset + p.length)
            if b > a:
                size = t.element_size()
                start = p.byte_start + (a - p.offset) * size
                wanted.append((p.object, start, start + (b - a) * size))
    merged: list[tuple[str, int, int]] = []
    for obj, a, b in sorted(wanted):
        if merged and merged[-1][0] == obj and merged[-1][2] == a:
            merged[-1] = (obj, merged[-1][1], b)
        else:
            merged.append((obj, a, b))
    return [(o, x, min(x + part, b)) for o, a, b in merged for x in range(a, b, part)]


def s3_load_phase(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Load the last round of ``s3_save_phase`` into a ``world``-rank layout with storage and with
    DCP's ``FsspecReader``; and get with s3fs, from storage's objects, exactly the bytes that hold
    this rank's elements (per the manifest; adjacent ranges merged, cut into ranged GETs of
    ``IOOptions().part_bytes``), all at once (``S3FileSystem.cat_ranges``)."""
    import s3fs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    target = make_state(cfg["shapes"], mesh, fill=False)
    s3 = cfg["s3"]
    opts, bucket, last = s3["options"], s3["bucket"], cfg["rounds"] - 1
    fs = s3fs.S3FileSystem(**opts)
    step_dir = f"{bucket}/ckpt/step-{100 + last}"
    where = f"{step_dir}/manifest.json"
    manifest = storage.format.Manifest.from_json(fs.cat(where), where=where)
    ranges = _needed_ranges(target, manifest, storage.IOOptions().part_bytes)
    paths = [f"{step_dir}/{o}" for o, _, _ in ranges]
    starts, ends = [a for _, a, _ in ranges], [b for _, _, b in ranges]
    total = _sum(sum(b - a for _, a, b in ranges))
    stats: dict[str, int] = {}

    def run(lib: str, dcp_path: str) -> float:
        if lib == "raw":
            fn: Callable[[], Any] = partial(fs.cat_ranges, paths, starts, ends)
        elif lib == "storage":

            def fn() -> None:
                res = storage.load(target, s3["url"], 100 + last, storage_options=opts)
                stats.update(read=res.bytes_read, needed=res.bytes_needed)
        else:
            reader = FsspecReader(dcp_path, **opts)
            fn = partial(dcp.load, target, storage_reader=reader)
        return _timed(fn)[0]

    for lib in S3_CONTENDERS:  # warm-up
        run(lib, f"s3://{bucket}/dcp-{last}")
        _zero(target)
    out: dict[str, list[float]] = {
        "storage.read_ratio": [_sum(stats["read"]) / _sum(stats["needed"])]
    }
    for rnd in range(cfg["rounds"]):
        for lib in _rotated(rnd):
            dt = run(lib, f"s3://{bucket}/dcp-{last}")
            out.setdefault(f"{lib}.load_gbps", []).append(
                (total if lib == "raw" else cfg["bytes"]) / dt / 1e9
            )
            if lib != "raw":
                if rnd == 0:
                    check_state(target)
                _zero(target)
    return out
