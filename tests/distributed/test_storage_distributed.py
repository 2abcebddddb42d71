"""Multi-rank save / load on real gloo groups: N -> M resharding, replica dedupe, async, DTensor.

One spawn of 4 ranks for the module (the fixture ``outcomes``); sub-groups of the first N ranks play
world sizes 1..4. Each scenario is a test of its own (``SCENARIOS``), so one failing does not hide
the others. Every loaded shard is compared bitwise with the slice of the unsharded reference that
layout would hold.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ftsdp import storage
from ftsdp.storage.format._manifest import Manifest
from ftsdp.storage.format._manifest import seal as storage_seal
from ftsdp.storage.saving import _save
from ftsdp.testing import run_ranks
from tests.s3_fixture import new_bucket_url

# Small checksum blocks so that bytes read stay within 5% of bytes needed for these sizes.
OPTIONS = storage.SaveOptions(checksum_block_bytes=256, object_bytes=300_000)
SHAPES = {"embed": (96, 64), "block.w": (64, 80), "block.b": (80,), "head": (80, 50)}


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _flat_layout(world: int) -> list[list[tuple[int, int]]]:
    """FSDP-style: all tensors concatenated, cut at uneven rank boundaries (weights 1, 2, ...).

    Returns, per rank, each tensor's ``(offset, length)`` (possibly empty).
    """
    sizes = [torch.Size(s).numel() for s in SHAPES.values()]
    total = sum(sizes)
    weights = list(range(1, world + 1))
    cuts = [total * sum(weights[:r]) // sum(weights) for r in range(world + 1)]
    out = []
    for r in range(world):
        lo, hi, start, mine = cuts[r], cuts[r + 1], 0, []
        for n in sizes:
            a, b = max(lo, start), min(hi, start + n)
            mine.append((a - start, max(b - a, 0)) if b > a else (0, 0))
            start += n
        out.append(mine)
    return out


def _state(rank: int, world: int, ref: dict[str, torch.Tensor], fill: float | None) -> dict:
    """Model + AdamW-like state of rank ``rank`` in a world of ``world`` (``fill``: blank)."""
    layout = _flat_layout(world)[rank]

    def shard(scale: float) -> dict[str, storage.FlatShard]:
        out = {}
        for (name, t), (off, n) in zip(ref.items(), layout, strict=True):
            local = (t * scale).reshape(-1)[off : off + n].clone()
            if fill is not None:
                local.fill_(fill)
            out[name] = storage.FlatShard(t.shape, off, local)
        return out

    step = torch.tensor(0.0 if fill is not None else 42.0)
    return {
        "model": shard(1.0),
        "optim": {"exp_avg": shard(0.5), "exp_avg_sq": shard(0.25), "step": step},
        "trainer": {"step": 0 if fill is not None else 42, "cursor": [7, 3]},
    }


def _check(state: dict, ref: dict[str, torch.Tensor], case: str) -> None:
    for group, scale in (("model", 1.0), ("exp_avg", 0.5), ("exp_avg_sq", 0.25)):
        shards = state["model"] if group == "model" else state["optim"][group]
        for name, s in shards.items():
            want = (ref[name] * scale).reshape(-1)[s.offset : s.offset + s.length]
            assert torch.equal(s.local, want), f"{case}: {group}.{name} differs"
    assert state["optim"]["step"].item() == 42.0 and state["trainer"]["step"] == 42, case


def _reshard_grid(
    rank: int, groups: dict[int, Any], root: str, opts: dict | None, cases: tuple
) -> None:
    ref = _reference()
    for n, m in cases:
        case, url = f"{n}->{m}", f"{root}/reshard-{n}-{m}"
        if rank < n:
            storage.save(
                _state(rank, n, ref, None),
                url,
                step=5,
                process_group=groups[n],
                storage_options=opts,
                options=OPTIONS,
            )
        dist.barrier()
        if rank < m:
            target = _state(rank, m, ref, fill=float("nan"))
            res = storage.load(target, url, process_group=groups[m], storage_options=opts)
            _check(target, ref, case)
            assert res.saved_world_size == n and res.step == 5
            assert res.bytes_read <= 1.05 * res.bytes_needed, (case, res)
        dist.barrier()


def _failed_load_is_atomic(rank: int, groups: dict[int, Any], root: str) -> None:
    """Corrupt bytes only rank 1 reads: every rank's load fails, rank 0's target is untouched."""
    ref, url = _reference(), f"{root}/atomic"
    if rank < 2:
        storage.save(_state(rank, 2, ref, None), url, step=1, process_group=groups[2])
    if rank == 0:
        tail = storage.catalog.read_manifest(url).tensors["model.head"].pieces[-1]
        path = f"{url}/step-1/{tail.object}"
        with open(path, "r+b") as f:
            f.seek(tail.byte_end - 1)
            byte = f.read(1)[0]
            f.seek(tail.byte_end - 1)
            f.write(bytes([byte ^ 0xFF]))
    dist.barrier()
    if rank < 2:
        target = _state(rank, 2, ref, fill=float("nan"))
        expected = pytest.raises(storage.CorruptCheckpointError, match="model.head")
        if rank == 0:
            expected = pytest.raises(storage.CheckpointError, match=r"failed on rank\(s\) \[1\]")
        with expected:
            storage.load(target, url, process_group=groups[2])
        for shards in (target["model"], target["optim"]["exp_avg"]):
            for s in shards.values():
                assert s.local.isnan().all(), "a failed load must not write anything"
        assert target["trainer"]["step"] == 0
    dist.barrier()


def _failed_save_leaves_no_objects(rank: int, world: int, root: str) -> None:
    """A write fails on one rank (rank 2, then rank 0): the save fails on every rank, and no
    object of it is left (each rank removes its own once rank 0 gave up: the failed rank at
    once, the others at the abort marker); the retry commits."""
    import errno
    import os

    ref, url = _reference(), f"{root}/failed-save"
    real = _save.write_object
    for step, failing in ((1, 2), (2, 0)):

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        _save.write_object = full if rank == failing else real
        try:
            with pytest.raises((OSError, storage.CheckpointError)):
                storage.save(_state(rank, world, ref, None), url, step, options=OPTIONS)
        finally:
            _save.write_object = real
        dist.barrier()
        left = sorted(p.name for p in Path(url, f"step-{step}").glob("*.safetensors"))
        assert left == [], f"step {step} (rank {failing} failed): {left}"
        dist.barrier()
        storage.save(_state(rank, world, ref, None), url, step, options=OPTIONS)
        target = _state(rank, world, ref, fill=float("nan"))
        storage.load(target, url, step)
        _check(target, ref, f"retry of step {step}")

    # Rank 2 cannot write its done marker (the disk filled up after its objects): it removes
    # its objects and reports in brief, so rank 0 gives up at once instead of waiting for the
    # marker until commit_timeout_s (the whole job hung), and no object is left.
    from dataclasses import replace

    from ftsdp.storage.saving import _commit

    real_marker = _commit._write_marker
    failed_once: list[int] = []

    def marker_fails_once(store: Any, rel: str, error: Any, **fields: Any) -> None:
        if "_done-" in rel and not failed_once:
            failed_once.append(1)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), rel)
        real_marker(store, rel, error, **fields)

    _commit._write_marker = marker_fails_once if rank == 2 else real_marker
    started = time.monotonic()
    try:
        with pytest.raises((OSError, storage.CheckpointError)):
            quick = replace(OPTIONS, commit_timeout_s=60.0)
            storage.save(_state(rank, world, ref, None), url, 4, options=quick)
    finally:
        _commit._write_marker = real_marker
    assert time.monotonic() - started < 30, "rank 0 waited for the marker that never came"
    dist.barrier()
    left = sorted(p.name for p in Path(url, "step-4").glob("*.safetensors"))
    assert left == [], f"step 4 (rank 2's marker failed): {left}"
    dist.barrier()

    # Rank 0 fails *after* creating the manifest (its listing after the commit): the step is
    # committed, so the other ranks, seeing the abort marker, must keep their objects.
    real_scan = _commit.scan_root

    def scan_fails_once_committed(store: Any, *args: Any, **kwargs: Any) -> Any:
        if store.exists("step-3/manifest.json"):
            raise OSError("injected: listing the root after the commit failed")
        return real_scan(store, *args, **kwargs)

    _commit.scan_root = scan_fails_once_committed if rank == 0 else real_scan
    try:  # rank 0 raises; the others return or raise, as they see the manifest or the marker
        storage.save(_state(rank, world, ref, None), url, 3, options=OPTIONS)
        assert rank > 0, "rank 0's failure after the commit was not raised"
    except (OSError, storage.CheckpointError) as e:
        assert rank == 0 or "aborted by rank 0" in str(e), e
    finally:
        _commit.scan_root = real_scan
    dist.barrier()
    assert 3 in storage.list_steps(url)
    target = _state(rank, world, ref, fill=float("nan"))
    storage.load(target, url, 3)
    _check(target, ref, "a step committed before rank 0 failed")
    dist.barrier()


def _dedupe_cases(rank: int, world: int, root: str) -> None:
    """Replicas (hybrid: 2 groups of 2) and whole tensors on all ranks are written once."""
    ref = _reference()
    pair = _flat_layout(2)[rank % 2]  # ranks {0, 2} and {1, 3} hold the same ranges
    state = {
        "w": {
            n: storage.FlatShard(t.shape, o, t.reshape(-1)[o : o + k].clone())
            for (n, t), (o, k) in zip(ref.items(), pair, strict=True)
        },
        "table": ref["embed"].clone(),  # replicated on every rank
    }
    opts = storage.SaveOptions(checksum_block_bytes=256, replica_split_bytes=4096)
    url = f"{root}/dedupe"
    storage.save(state, url, step=1, options=opts)
    manifest = storage.catalog.read_manifest(url)
    payload = sum(p.length * 4 for t in manifest.tensors.values() for p in t.pieces)
    assert payload == sum(t.numel() * 4 for t in ref.values()) + ref["embed"].numel() * 4
    writers = {p.object[:9] for t in manifest.tensors.values() for p in t.pieces}
    assert writers == {f"rank{r:05d}" for r in range(world)}, writers  # work is spread
    table_writers = {p.object[:9] for p in manifest.tensors["table"].pieces}
    assert len(table_writers) == world  # a big replicated tensor is split among its holders
    full = storage.load_state_dict(url)
    for n, t in ref.items():
        assert torch.equal(full[f"w.{n}"], t)
    assert torch.equal(full["table"], ref["embed"])


def _async_cases(rank: int, world: int, root: str) -> None:
    ref = _reference()
    url = f"{root}/async"
    state = _state(rank, world, ref, None)
    h = storage.save(state, url, step=1, async_save=True, options=OPTIONS)
    # Training goes on with collectives while the upload runs in the background.
    x = torch.ones(4) * rank
    for _ in range(3):
        dist.all_reduce(x)
    state["model"]["embed"].local.zero_()
    h.wait()
    assert h.done() and h.blocking_seconds > 0
    target = _state(rank, world, ref, fill=float("nan"))
    storage.load(target, url)
    _check(target, ref, "async")

    # A failure on one rank fails the save on every rank (nobody hangs) and commits nothing.
    if rank == 2:
        from ftsdp.storage.io._fs import Store

        real = Store._write_once

        def broken(self: Store, rel: str, produce: Any) -> None:
            if rel.endswith(".safetensors"):
                raise OSError("injected: disk full on rank 2")
            real(self, rel, produce)

        Store._write_once = broken
    h = storage.save(_state(rank, world, ref, None), url, step=2, async_save=True, options=OPTIONS)
    with pytest.raises((OSError, storage.CheckpointError)) as err:
        h.wait()
    assert "rank 2" in str(err.value), err.value
    if rank == 2:
        Store._write_once = real
    dist.barrier()
    assert storage.list_steps(url) == [1]
    storage.save(_state(rank, world, ref, None), url, step=3, async_save=True).wait()
    assert storage.list_steps(url) == [1, 3]


def _deferred_cases(rank: int, world: int, root: str, pair: Any) -> None:
    """save(defer_copy=True) returns before copying; the loop changes every saved tensor at once
    (an optimizer step behind the fence, collectives on the default group in between), yet the
    checkpoint holds the values of the moment of the save: copied into the snapshot memory
    first under a disk root, written from the live tensors under a tmpfs one."""
    shm = f"/dev/shm/ftsdp-test-{hashlib.sha1(root.encode()).hexdigest()[:12]}"
    try:
        _deferred_saves(rank, world, f"{shm}/deferred", in_place=True)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shm, ignore_errors=True)
    _deferred_saves(rank, world, f"{root}/deferred", in_place=False)
    _deferred_errors(rank, world, f"{root}/deferred", pair)


def _deferred_saves(rank: int, world: int, url: str, in_place: bool) -> None:
    ref = _reference()
    state = _state(rank, world, ref, None)
    leaves = [
        *state["model"].values(),
        *state["optim"]["exp_avg"].values(),
        *state["optim"]["exp_avg_sq"].values(),
    ]
    live = [s.local for s in leaves if s.length] + [state["optim"]["step"]]
    for t in live:
        t.grad = torch.ones_like(t)
    opt = torch.optim.SGD(live, lr=1000.0)
    fence = storage.saving.snapshot_fence(opt)
    # The own group and this rank's snapshot memory; none on tmpfs, written in place
    assert (storage.saving.prepare_save(state, url) == 0) == in_place
    for step in (1, 2):
        expected = [t.clone() for t in live]
        cursor = list(state["trainer"]["cursor"])
        h = storage.save(state, url, step, async_save=True, defer_copy=True, options=OPTIONS)
        state["trainer"]["cursor"].append(step)  # JSON values are copied by save() itself
        x = torch.ones(4)
        dist.all_reduce(x)  # the loop's own collectives while the save exchanges its metadata
        opt.step()  # every saved tensor changes in place, right after save() returned
        assert not torch.equal(live[0], expected[0])
        h.wait()
        assert h.snapshot_seconds > 0 and h.done()
        target = _state(rank, world, ref, fill=float("nan"))
        storage.load(target, url, step)
        got = [
            *target["model"].values(),
            *target["optim"]["exp_avg"].values(),
            *target["optim"]["exp_avg_sq"].values(),
        ]
        got = [g.local for g, s in zip(got, leaves, strict=True) if s.length]
        for g, want in zip([*got, target["optim"]["step"]], expected, strict=True):
            assert torch.equal(g, want), f"deferred save of step {step} holds later values"
        assert target["trainer"]["cursor"] == cursor
        if step == 1:
            _check(target, ref, "deferred")
    fence.remove()
    assert (_save._lanes[url].arena.held_bytes() == 0) == in_place


def _deferred_errors(rank: int, world: int, url: str, pair: Any) -> None:
    ref = _reference()
    # A bad state on one rank: that rank raises at once, the others from wait(); none hangs.
    state = _state(rank, world, ref, None)
    if rank == 1:
        state["trainer"]["bad"] = object()
        with pytest.raises(TypeError, match="trainer.bad"):
            storage.save(state, url, 5, async_save=True, defer_copy=True)
    else:
        h = storage.save(state, url, 5, async_save=True, defer_copy=True)
        with pytest.raises(storage.CheckpointError, match="rank 1"):
            h.wait()
    dist.barrier()
    assert storage.list_steps(url) == [1, 2]

    # Ranks that save different steps (a loop that went on after a save failed on one rank)
    # are told so at once, on every rank, deferred or not, and nothing is committed.
    good = _state(rank, world, ref, None)
    for defer in (True, False):
        step = 7 if rank == 1 else 8
        with pytest.raises(storage.CheckpointError, match="not saving the same step"):
            storage.save(good, url, step, async_save=defer, defer_copy=defer).wait()
    assert storage.list_steps(url) == [1, 2]

    # Over a subgroup (ranks 0 and 1) the metadata exchange runs on the caller's thread; the
    # copy is still deferred behind the fence.
    if rank < 2:
        state = _state(rank, 2, ref, None)
        moment = {n: s.local.clone() for n, s in state["model"].items()}
        h = storage.save(
            state, f"{url}-pair", 1, process_group=pair, async_save=True, defer_copy=True
        )
        storage.saving.wait_snapshot()
        for s in state["model"].values():
            s.local.zero_()
        h.wait()
        target = _state(rank, 2, ref, fill=float("nan"))
        storage.load(target, f"{url}-pair", process_group=pair)
        for n, s in target["model"].items():
            assert torch.equal(s.local, moment[n])
    dist.barrier()


def _dtensor_cases(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    full = {"a": torch.randn(7, 6, generator=g), "b": torch.randn(9, generator=g)}
    mesh2 = init_device_mesh("cpu", (2, 2))
    mesh1 = init_device_mesh("cpu", (world,))
    saved = {k: distribute_tensor(v, mesh2, [Replicate(), Shard(0)]) for k, v in full.items()}
    url = f"{root}/dtensor"
    storage.save(saved, url, step=1)
    target = {k: distribute_tensor(torch.zeros_like(v), mesh1, [Shard(0)]) for k, v in full.items()}
    storage.load(target, url)
    for k, v in full.items():
        assert torch.equal(target[k].full_tensor(), v)
    full_sd = storage.load_state_dict(url)
    for k, v in full.items():
        assert torch.equal(full_sd[k], v)
    # The same DTensors again (their ranges found by identity), then the same shapes placed
    # otherwise on the same mesh: each step holds the values of its own layout.
    storage.save(saved, url, step=2)
    other = {k: distribute_tensor(v * 2, mesh2, [Shard(0), Replicate()]) for k, v in full.items()}
    storage.save(other, url, step=3)
    for step, factor in ((2, 1), (3, 2)):
        target = {
            k: distribute_tensor(torch.zeros_like(v), mesh1, [Shard(0)]) for k, v in full.items()
        }
        storage.load(target, url, step)
        for k, v in full.items():
            assert torch.equal(target[k].full_tensor(), v * factor), (step, k)
    # The same DTensor changed in place, saved under two names: the values of that moment.
    with torch.no_grad():
        saved["a"].mul_(3)
    storage.save({"a": saved["a"], "c": saved["a"]}, url, step=4)
    got = storage.load_state_dict(url, step=4)
    assert torch.equal(got["a"], full["a"] * 3) and torch.equal(got["c"], full["a"] * 3)


def _even_state(rank: int, world: int, ref: dict[str, torch.Tensor], fill: float | None) -> dict:
    """What FSDP holds: the tensors concatenated and cut into ``world`` equal chunks (each leaf
    says where it sits: ``FlatShard.layout``), a ``Shard(0)``-like row split, and replicas."""
    sizes = {n: t.numel() for n, t in ref.items()}
    chunk = -(-sum(sizes.values()) // world)
    flat, start = {}, 0
    for name, t in ref.items():
        lo = min(max(rank * chunk - start, 0), t.numel())
        hi = min(max((rank + 1) * chunk - start, 0), t.numel())
        local = t.reshape(-1)[lo:hi].clone()
        if fill is not None:
            local.fill_(fill)
        flat[name] = storage.FlatShard(t.shape, lo, local, layout=(start, chunk))
        start += t.numel()
    rows = -(-ref["embed"].shape[0] // world)
    part = ref["embed"][rank * rows : (rank + 1) * rows].reshape(-1).clone()
    if fill is not None:
        part.fill_(fill)
    row = ref["embed"].shape[1]
    return {
        "flat": flat,
        "rows": storage.FlatShard(ref["embed"].shape, rank * rows * row, part),
        "small": ref["block.b"].clone() if fill is None else torch.zeros(80),
        "big": ref["head"].clone() if fill is None else torch.zeros(80, 50),
        "uneven": _state(rank, world, ref, fill)["model"]["head"],  # no rule: the coordinator's
    }


def _one_checksum_less(blob: str) -> str:
    return base64.b64encode(base64.b64decode(blob)[:-4]).decode()


def _regular_cases(rank: int, groups: dict[int, Any], root: str) -> None:
    """Rule-described layouts (docs/format.md, version 4): saved without exchanging ranges,
    described by their rule in the manifest, loaded at another world size bitwise; the
    manifest is smaller than listing every piece; a damaged rule table is refused."""
    ref = _reference()
    opts = storage.SaveOptions(checksum_block_bytes=256, replica_split_bytes=8000)
    url = f"{root}/regular"
    if rank < 4:
        storage.save(
            _even_state(rank, 4, ref, None), url, step=3, process_group=groups[4], options=opts
        )
    dist.barrier()
    manifest = storage.catalog.read_manifest(url)
    assert manifest.version == 4 and manifest.regular is not None
    rules = {n: (t.rule.kind if t.rule else None) for n, t in manifest.tensors.items()}
    assert rules == {
        **{f"flat.{n}": "even" for n in ref},
        "rows": "even",
        "small": "writer",
        "big": "even",  # replicated and >= replica_split_bytes: split over the ranks
        "uneven": None,
    }, rules
    assert sum(manifest.regular.counts) >= 4  # every rank wrote its own regular object
    for m in (3, 2, 1):  # reshard 4 -> m, the same rule on the new world
        if rank < m:
            target = _even_state(rank, m, ref, fill=float("nan"))
            res = storage.load(target, url, process_group=groups[m])
            want = _even_state(rank, m, ref, None)
            for name in target["flat"]:
                assert torch.equal(target["flat"][name].local, want["flat"][name].local), (m, name)
            for key in ("rows", "uneven"):
                assert torch.equal(target[key].local, want[key].local), (m, key)
            assert torch.equal(target["small"], ref["block.b"]) and torch.equal(
                target["big"], ref["head"]
            )
            assert res.bytes_read <= 1.05 * res.bytes_needed + 4 * 256, res
        dist.barrier()
    if rank == 0:
        full = storage.load_state_dict(url)
        for n, t in ref.items():
            assert torch.equal(full[f"flat.{n}"], t), n
        assert torch.equal(full["rows"], ref["embed"]) and torch.equal(full["uneven"], ref["head"])
        assert storage.catalog.verify(url).ok
        data = (Path(url) / "step-3" / "manifest.json").read_bytes()
        doc = json.loads(data)
        assert "pieces" not in doc["tensors"]["flat.embed"]  # the rule, not 4 pieces
        # rank 0 committed: its reads get the manifest it wrote (not decoded again), which must
        # be what decoding its bytes gives, derived pieces included
        written = storage.catalog.read_manifest(url)
        decoded = Manifest.from_json(data, where=url)
        assert written.to_json() == data
        assert written == decoded and written.regular is not None
        for name, t in decoded.tensors.items():
            assert written.tensors[name].pieces == t.pieces, name
        bad = Path(root) / "regular-bad" / "step-3"
        bad.mkdir(parents=True)
        for f in (Path(url) / "step-3").iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        edits = {  # each resealed: self-consistent edits that only the layout rule can catch
            "one more object than the rule gives": (0, lambda k: k + 1, "not listed in objects"),
            "a checksum short": (1, _one_checksum_less, "rank 1's regular objects: the layout has"),
        }
        for what, (field, edit, match) in edits.items():
            changed = json.loads(json.dumps(doc))
            changed["regular"]["ranks"][1][field] = edit(changed["regular"]["ranks"][1][field])
            (bad / "manifest.json").write_bytes(json.dumps(storage_seal(changed)).encode())
            with pytest.raises(storage.CorruptCheckpointError, match=match):
                storage.load_state_dict(str(bad.parent))
            print(what, "refused")
    dist.barrier()
    # Tables that differ between ranks (a tensor only rank 0 has) go to the coordinator whole.
    url = f"{root}/regular-differ"
    if rank < 2:
        state = _even_state(rank, 2, ref, None)
        if rank == 0:
            state["only0"] = ref["block.w"].clone()
        storage.save(state, url, step=1, process_group=groups[2], options=opts)
        assert storage.catalog.read_manifest(url).regular is None
    dist.barrier()
    if rank == 0:
        full = storage.load_state_dict(url)
        assert torch.equal(full["only0"], ref["block.w"]) and torch.equal(
            full["rows"], ref["embed"]
        )
    dist.barrier()


def _odd_rows_state(rank: int, world: int, fill: float | None) -> dict[str, Any]:
    """Row splits (``Shard(0)``-like) of tensors with no elements or fewer rows than ranks, a
    tensor in a flat buffer of a larger chunk (all of it on rank 0), and a replicated scalar."""
    g = torch.Generator().manual_seed(1)
    ref = {"z0": torch.zeros(0, 5), "z1": torch.zeros(3, 0), "few": torch.randn(2, 5, generator=g)}
    out: dict[str, Any] = {}
    for name, t in ref.items():
        rows, row = -(-t.shape[0] // world), t[0].numel() if t.shape[0] else 0
        lo, hi = min(rank * rows, t.shape[0]), min((rank + 1) * rows, t.shape[0])
        out[name] = storage.FlatShard(t.shape, lo * row, t[lo:hi].reshape(-1).clone())
    v = torch.randn(6, generator=g)
    out["buffer"] = storage.FlatShard((6,), 0, v if rank == 0 else v[:0], layout=(0, 100))
    out["scalar"] = torch.tensor(3.5)
    if fill is not None:
        for leaf in out.values():
            (leaf.local if isinstance(leaf, storage.FlatShard) else leaf).fill_(fill)
    return out


def _regular_edges(rank: int, groups: dict[int, Any], root: str) -> None:
    """Rules with empty ranks and empty tensors load bitwise at another world size; a
    ``FlatShard.layout`` whose chunk does not fit in int64 (on one rank only: its own range
    agrees) costs the rule, not a hang (the rule exchange once overflowed on that rank alone,
    the others waiting in the all-reduce); a rank holding no tensor saves with the others;
    ranks saving with other object sizes commit a readable step, with other checksum block
    sizes none."""
    opts = storage.SaveOptions(checksum_block_bytes=256)
    url = f"{root}/regular-odd"
    storage.save(_odd_rows_state(rank, 4, None), url, step=1, options=opts)
    if rank < 3:
        target = _odd_rows_state(rank, 3, fill=float("nan"))
        storage.load(target, url, process_group=groups[3])
        want = _odd_rows_state(rank, 3, None)
        for name, leaf in want.items():
            got = target[name]
            same = (
                torch.equal(got.local, leaf.local)
                if isinstance(leaf, storage.FlatShard)
                else torch.equal(got, leaf)
            )
            assert same, name
    t = torch.arange(6.0)
    huge = {"x": storage.FlatShard((6,), 0, t.clone(), layout=(0, 2**64))}
    honest = {"x": storage.FlatShard((6,), 0, t[:0].clone(), layout=(0, 6))}
    url = f"{root}/regular-huge-chunk"
    storage.save(huge if rank == 0 else honest, url, step=1, options=opts)
    dist.barrier()
    if rank == 0:
        assert (
            storage.catalog.read_manifest(url).tensors["x"].rule is None
        )  # the coordinator planned it
        assert torch.equal(storage.load_state_dict(url)["x"], t)
    # A rank holding no tensor at all (the others' tables differ from its empty one): it once
    # skipped the gather and scatter of the coordinator's plan, the others waiting for it.
    url = f"{root}/regular-rank-holds-none"
    storage.save({"x": t.clone()} if rank < 3 else {"n": 3}, url, step=1, options=opts)
    dist.barrier()
    if rank == 0:
        assert torch.equal(storage.load_state_dict(url)["x"], t)
    # Ranks packing objects of other sizes: once committed, a step whose rank 1.. objects the
    # reader (deriving them with rank 0's object_bytes) refused; now rank 0 plans them.
    url = f"{root}/regular-other-options"
    ref = _reference()
    other = storage.SaveOptions(checksum_block_bytes=256, object_bytes=4096 if rank else 300_000)
    storage.save(_even_state(rank, 4, ref, None), url, step=1, options=other)
    dist.barrier()
    if rank == 0:
        full = storage.load_state_dict(url)
        for n, want in ref.items():
            assert torch.equal(full[f"flat.{n}"], want), n
    # Other checksum block sizes: one manifest lists one size, so the save is refused on every
    # rank before anything is written (it once committed a step no reader accepted).
    other = storage.SaveOptions(checksum_block_bytes=256 if rank else 512)
    with pytest.raises(storage.CheckpointError, match="checksum blocks of 256 to 512 bytes"):
        storage.save(_even_state(rank, 4, ref, None), url, step=2, options=other)
    dist.barrier()


def _golden_v4_writer(rank: int, groups: dict[int, Any], root: str) -> None:
    """Today's writer, saving the golden version 4 state on 3 ranks, writes the golden objects
    byte for byte and the same manifest but for the attempt id (tests/golden/storage_v4)."""
    from tests.make_storage_golden_v4 import GOLDEN_V4, OPTIONS, STEP, rank_state

    url = f"{root}/golden-v4"
    if rank < 3:
        storage.save(rank_state(rank, 3), url, step=STEP, process_group=groups[3], options=OPTIONS)
    dist.barrier()
    if rank == 0:
        new, old = Path(url) / f"step-{STEP}", GOLDEN_V4 / f"step-{STEP}"
        docs = [json.loads((d / "manifest.json").read_text()) for d in (new, old)]
        for doc in docs:
            attempt = doc.pop("attempt")
            doc.pop("manifest_checksum")
            doc["objects"] = {k.replace(attempt, "*"): v for k, v in doc["objects"].items()}
            for t in doc["tensors"].values():
                for p in t.get("pieces", []):
                    p["object"] = p["object"].replace(attempt, "*")
        assert docs[0] == docs[1]
        objects = [sorted(d.glob("*.safetensors")) for d in (new, old)]
        assert [p.read_bytes() for p in objects[0]] == [p.read_bytes() for p in objects[1]]
    dist.barrier()


def _json_collectives(rank: int, groups: dict[int, Any]) -> None:
    """storage's JSON collectives against the objects sent: a broadcast that fits in its first
    frame and one that needs a second, and a gather, an all-gather and a scatter of messages
    of very different lengths (an empty one among them), over every rank and over a subgroup
    of 3 (ranks 0-2)."""
    from ftsdp.storage.io._collectives import (
        _FIRST,
        all_gather_json,
        broadcast_json,
        gather_json,
        scatter_json,
    )

    for n in (4, 3):
        if rank >= n:
            continue
        group = groups[n]
        for sent in ({"a": [1, 2.5, None], "é": "ü"}, {"big": "x" * (_FIRST + 999)}, ""):
            assert broadcast_json(sent if rank == 0 else None, group) == sent
        mine = ["", {"r": rank}, "y" * (3 * _FIRST + rank), [rank] * 5][rank]
        got = gather_json(mine, group)
        expect = ["", {"r": 1}, "y" * (3 * _FIRST + 2), [3] * 5][:n]
        assert got == (expect if rank == 0 else None), (n, rank)
        assert all_gather_json(expect[rank], group) == expect, (n, rank)  # rank 0's: empty
        parts = [{"to": r, "pad": "z" * (r * 5000)} for r in range(n)]
        assert scatter_json(parts if rank == 0 else None, group) == parts[rank], (n, rank)


def _values_cases(rank: int, groups: dict[int, Any], root: str) -> None:
    """Each rank's JSON values reach the manifest through its done marker: ``values`` are rank
    0's, ``rank_values[r]`` the ones of rank r that differ from them or that rank 0 lacks, and
    each rank loads back its own; over every rank and over a subgroup of 3, with a synchronous,
    an async and a deferred save, and a save that replaces a committed step (``discard_newer``:
    the attempt it replaces is broadcast)."""
    ref = _reference()

    def values(r: int) -> dict[str, Any]:
        mine = {"step": 42, "cursor": [7, 3], "rank": r, "seed": "even" if r % 2 == 0 else f"s{r}"}
        if r:
            mine["not_on_0"] = [r, "x"]
        return mine

    for n in (4, 3):
        if rank >= n:
            continue
        url = f"{root}/values-{n}"
        state = _state(rank, n, ref, None)
        state["trainer"] = values(rank)
        kinds = [{}, {"async_save": True}, {"async_save": True, "defer_copy": True}]
        for step, kw in enumerate(kinds, start=1):
            storage.save(state, url, step, process_group=groups[n], **kw).wait(60)
        first = storage.catalog.read_manifest(url, 3).attempt
        storage.save(
            state,
            url,
            3,
            process_group=groups[n],
            options=storage.SaveOptions(discard_newer=True),
        )
        for step in (1, 2, 3):
            m = storage.catalog.read_manifest(url, step)
            assert m.values == {f"trainer.{k}": v for k, v in values(0).items()}, (n, step)
            for r in range(n):
                differ = {k: v for k, v in values(r).items() if values(0).get(k) != v}
                assert m.rank_values[r] == {f"trainer.{k}": v for k, v in differ.items()}, r
        assert storage.catalog.read_manifest(url, 3).attempt != first  # replaced
        target = _state(rank, n, ref, 0.0)
        target["trainer"] = {k: None for k in values(rank)}
        storage.load(target, url, 3, process_group=groups[n])
        assert target["trainer"] == values(rank), (n, rank)
        dist.barrier(groups[n])


RESHARDS = ((2, 1), (2, 3), (3, 2), (4, 3), (1, 4))
SCENARIOS = [
    "json collectives",
    *(f"reshard {n}->{m}" for n, m in RESHARDS),
    "reshard 3->2 on s3",
    "failed load is atomic",
    "failed save leaves no objects",
    "dedupe",
    "async",
    "deferred",
    "dtensor",
    "regular",
    "regular edges",
    "golden v4 writer",
    "values",
]
REJOIN_S = 60  # how long a rank that finished a scenario waits for the others to finish it


def _calls(rank: int, world: int, root: str, s3_root: str, s3_opts: dict) -> dict[str, Any]:
    """Each scenario of ``SCENARIOS`` as a call of no arguments, in order."""
    groups = {n: dist.new_group(list(range(n))) for n in range(1, world + 1)}
    calls: dict[str, Any] = {"json collectives": lambda: _json_collectives(rank, groups)}
    for n, m in RESHARDS:
        calls[f"reshard {n}->{m}"] = lambda c=(n, m): _reshard_grid(rank, groups, root, None, (c,))
    calls.update({
        "reshard 3->2 on s3": lambda: _reshard_grid(rank, groups, s3_root, s3_opts, ((3, 2),)),
        "failed load is atomic": lambda: _failed_load_is_atomic(rank, groups, root),
        "failed save leaves no objects": lambda: _failed_save_leaves_no_objects(rank, world, root),
        "dedupe": lambda: _dedupe_cases(rank, world, root),
        "async": lambda: _async_cases(rank, world, root),
        "deferred": lambda: _deferred_cases(rank, world, root, groups[2]),
        "dtensor": lambda: _dtensor_cases(rank, world, root),
        "regular": lambda: _regular_cases(rank, groups, root),
        "regular edges": lambda: _regular_edges(rank, groups, root),
        "golden v4 writer": lambda: _golden_v4_writer(rank, groups, root),
        "values": lambda: _values_cases(rank, groups, root),
    })  # fmt: skip
    assert list(calls) == SCENARIOS
    return calls


def _main(rank: int, world: int, root: str, s3_root: str, s3_opts: dict) -> dict[str, str | None]:
    """Every scenario in turn; per scenario None, or the traceback it raised on this rank.

    After each scenario the ranks meet in the c10d store (not in a collective, which a rank that
    left a scenario early could pair with one of the next): when a rank does not arrive within
    ``REJOIN_S`` (stuck in a collective of a scenario another rank left), the rank raises with
    what failed so far, so that the spawn ends instead of running on out of step."""
    store = dist.distributed_c10d._get_default_store()
    out: dict[str, str | None] = {}
    for i, (name, call) in enumerate(_calls(rank, world, root, s3_root, s3_opts).items()):
        try:
            call()
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()
        store.set(f"scenario/{i}/{rank}", "done")
        try:
            store.wait(
                [f"scenario/{i}/{r}" for r in range(world)], datetime.timedelta(seconds=REJOIN_S)
            )
        except Exception as e:
            failed = "\n".join(f"{k}:\n{tb}" for k, tb in out.items() if tb is not None)
            raise RuntimeError(
                f"rank {rank}: not every rank finished scenario {name!r} within {REJOIN_S} s ({e}); "
                f"failures on this rank so far:\n{failed or 'none'}"
            ) from None
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: dict) -> list[dict]:
    """One spawn of 4 ranks for the whole module: every rank's outcome of every scenario."""
    import s3fs

    root = tmp_path_factory.mktemp("storage-multirank")
    s3_root = new_bucket_url(s3_endpoint)
    try:
        return run_ranks(
            _main, 4, str(root), s3_root, dict(s3_endpoint), timeout=240, start_method="forkserver"
        )
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.timeout(300)  # the first one waits for the spawn
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_storage_multirank(outcomes: list[dict], scenario: str) -> None:
    failed = [(r, o[scenario]) for r, o in enumerate(outcomes) if o[scenario] is not None]
    assert not failed, "\n\n".join(f"rank {r}:\n{tb}" for r, tb in failed)
