"""The storage contract, run against every backend: local directory, memory://, S3 (SeaweedFS).

Each test compares what comes back with the original tensors, bitwise.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import fsspec
import pytest
import torch

from ftsdp import storage

SMALL_BLOCKS = storage.SaveOptions(checksum_block_bytes=64, object_bytes=6000)


@pytest.fixture(params=["local", "memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict | None]:
    """``(url, storage_options)`` of an empty checkpoint root on each backend."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:8]}", None
    opts = request.getfixturevalue("s3_endpoint")
    return request.getfixturevalue("s3_bucket_url"), dict(opts)


def _fs(url: str, opts: dict | None) -> tuple[Any, str]:
    return fsspec.core.url_to_fs(url, **(opts or {}))


def _put(fs: Any, path: str, data: bytes) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def _reference() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(40, 30, generator=g),
            "b": torch.randn(30, generator=g).to(torch.bfloat16),
            "layers": [torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.rand(5) > 0.5],
        },
        "optim": {
            "exp_avg": torch.randn(40, 30, generator=g),
            "step": torch.tensor(17.0),
            "empty": torch.zeros(0, 3),
        },
        "trainer": {"step": 17, "lr": 0.5, "tags": ["a", None], "cursor": {"epoch": 2}},
    }


def _zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list) and any(isinstance(v, torch.Tensor) for v in state):
        return [_zeros_like(v) for v in state]
    return None


def _assert_same(got: Any, ref: Any) -> None:
    if isinstance(ref, torch.Tensor):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, ref)
    elif isinstance(ref, dict):
        assert got.keys() == ref.keys()
        for k in ref:
            _assert_same(got[k], ref[k])
    elif isinstance(ref, list) and any(isinstance(v, torch.Tensor) for v in ref):
        for a, b in zip(got, ref, strict=True):
            _assert_same(a, b)
    else:
        assert got == ref


def test_save_load_roundtrip(backend: tuple[str, dict | None]) -> None:
    url, opts = backend
    ref = _reference()
    storage.save(ref, url, step=17, storage_options=opts)
    assert storage.list_steps(url, storage_options=opts) == [17]
    target = _zeros_like(ref)
    result = storage.load(target, url, storage_options=opts)
    _assert_same(target, ref)
    assert result.step == 17 and result.bytes_read == result.bytes_needed
    full = storage.load_state_dict(url, storage_options=opts)
    torch.testing.assert_close(full["model.w"], ref["model"]["w"], rtol=0, atol=0)
    assert torch.equal(full["model.layers.1"], ref["model"]["layers"][1])
    half = storage.load_state_dict(url, keys=["model.w"], dtype=torch.float16, storage_options=opts)
    assert list(half) == ["model.w"] and torch.equal(half["model.w"], ref["model"]["w"].half())
    # The 'latest' marker names the newest committed step.
    fs, root = _fs(url, opts)
    assert fs.cat_file(f"{root}/latest").decode().strip() == "17"


def test_reshard_reads_only_needed_bytes(backend: tuple[str, dict | None]) -> None:
    """Saved whole, loaded as uneven flat ranges (as 3 ranks would): exact bytes, little extra."""
    url, opts = backend
    g = torch.Generator().manual_seed(1)
    full = {"a": torch.randn(64, 50, generator=g), "b": torch.randn(3001, generator=g)}
    storage.save(full, url, step=1, storage_options=opts, options=SMALL_BLOCKS)
    for name, ref in full.items():
        n = ref.numel()
        bounds = [0, n // 5, n // 5 + n // 2 + 3, n]  # uneven thirds
        for lo, hi in itertools.pairwise(bounds):
            shard = storage.FlatShard(ref.shape, lo, torch.full((hi - lo,), float("nan")))
            res = storage.load({name: shard}, url, storage_options=opts, strict=False)
            assert res.unexpected == sorted(set(full) - {name})
            assert torch.equal(shard.local, ref.reshape(-1)[lo:hi])
            assert res.bytes_needed == (hi - lo) * 4
            assert res.bytes_read <= 1.05 * res.bytes_needed, (res.bytes_read, res.bytes_needed)


def test_uncommitted_step_is_invisible(backend: tuple[str, dict | None]) -> None:
    url, opts = backend
    ref = _reference()
    storage.save(ref, url, step=1, storage_options=opts)
    storage.save(ref, url, step=2, storage_options=opts)
    fs, root = _fs(url, opts)
    fs.rm(f"{root}/step-2/manifest.json")  # as if the writer died before the commit
    _put(fs, f"{root}/step-3/rank00000-000-deadbeef.safetensors", b"partial")
    fs.invalidate_cache()
    assert storage.list_steps(url, storage_options=opts) == [1]
    target = _zeros_like(ref)
    assert storage.load(target, url, storage_options=opts).step == 1
    _assert_same(target, ref)
    with pytest.raises(storage.CheckpointNotFoundError, match="step 2 is not committed"):
        storage.load(_zeros_like(ref), url, step=2, storage_options=opts)


def test_retention(backend: tuple[str, dict | None]) -> None:
    url, opts = backend
    state = {"x": torch.arange(10.0)}
    fs, root = _fs(url, opts)
    for step in range(1, 8):
        keep = storage.SaveOptions(keep_last=2, keep_every=3)
        storage.save(state, url, step=step, options=keep, storage_options=opts)
    assert storage.list_steps(url, storage_options=opts) == [3, 6, 7]
    # A torn attempt older than the newest commit is garbage; a newer one may be in progress.
    _put(fs, f"{root}/step-5/rank00000-000-aaaaaaaa.safetensors", b"torn")
    _put(fs, f"{root}/step-9/rank00000-000-bbbbbbbb.safetensors", b"in progress")
    _put(fs, f"{root}/step-7/rank00001-000-cccccccc.safetensors", b"stray of a torn attempt")
    fs.invalidate_cache()
    fresh = storage.catalog.apply_retention(url, keep_last=1, storage_options=opts)
    assert fresh == [
        3,
        6,
    ]  # the torn step 5 and step 7's stray were written just now: may be a save
    fs.invalidate_cache()
    removed = storage.catalog.apply_retention(url, keep_last=1, grace_s=0, storage_options=opts)
    assert removed == [5]
    fs.invalidate_cache()
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert names == ["latest", "step-7", "step-9"]
    step7 = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/step-7", detail=False))
    assert "rank00001-000-cccccccc.safetensors" not in step7 and "manifest.json" in step7
    target = {"x": torch.zeros(10)}
    storage.load(target, url, storage_options=opts)
    assert torch.equal(target["x"], state["x"])


def _object_names(url: str, opts: dict | None, step: int) -> list[str]:
    manifest = json.loads(
        _fs(url, opts)[0].cat_file(f"{_fs(url, opts)[1]}/step-{step}/manifest.json")
    )
    return sorted(manifest["objects"])


def test_flipped_byte_is_detected(backend: tuple[str, dict | None]) -> None:
    url, opts = backend
    ref = _reference()
    storage.save(ref, url, step=4, storage_options=opts)
    fs, root = _fs(url, opts)
    manifest = json.loads(fs.cat_file(f"{root}/step-4/manifest.json"))
    piece = manifest["tensors"]["optim.exp_avg"]["pieces"][0]
    path = f"{root}/step-4/{piece['object']}"
    data = bytearray(fs.cat_file(path))
    data[piece["byte_range"][0] + 101] ^= 0x10
    fs.pipe_file(path, bytes(data))
    target = _zeros_like(ref)
    with pytest.raises(storage.CorruptCheckpointError) as err:
        storage.load(target, url, storage_options=opts)
    msg = str(err.value)
    assert "optim.exp_avg" in msg and "step 4" in msg and piece["object"] in msg
    _assert_same(target, _zeros_like(ref))  # nothing was loaded
    report = storage.catalog.verify(url, storage_options=opts)
    assert not report.ok and any(piece["object"] in p for p in report.problems), report
    # Tensors in other byte ranges still load.
    other = {"model": {"w": torch.zeros(40, 30)}}
    storage.load(other, url, storage_options=opts, strict=False)
    assert torch.equal(other["model"]["w"], ref["model"]["w"])


def test_missing_or_truncated_object(backend: tuple[str, dict | None]) -> None:
    url, opts = backend
    ref = _reference()
    storage.save(ref, url, step=5, storage_options=opts)
    storage.save(ref, url, step=6, storage_options=opts)
    fs, root = _fs(url, opts)
    (obj5,) = _object_names(url, opts, 5)
    fs.rm(f"{root}/step-5/{obj5}")
    (obj6,) = _object_names(url, opts, 6)
    _put(fs, f"{root}/step-6/{obj6}", fs.cat_file(f"{root}/step-6/{obj6}")[:-1])
    fs.invalidate_cache()
    for step, match in ((5, "is missing"), (6, "bytes, the manifest lists")):
        target = _zeros_like(ref)
        with pytest.raises(storage.IncompleteCheckpointError, match=match):
            storage.load(target, url, step=step, storage_options=opts)
        _assert_same(target, _zeros_like(ref))


def test_async_save(backend: tuple[str, dict | None]) -> None:
    url, opts = backend
    ref = _reference()
    state = _zeros_like(ref)
    for k in ("model", "optim"):
        for name, t in ref[k].items():
            if isinstance(t, torch.Tensor):
                state[k][name] = t.clone()
    state["model"]["layers"] = [t.clone() for t in ref["model"]["layers"]]
    state["trainer"] = dict(ref["trainer"])
    handle = storage.save(state, url, step=8, async_save=True, storage_options=opts)
    state["model"]["w"].add_(1.0)  # after save() returns the caller may train on
    handle.wait()
    assert handle.done() and handle.blocking_seconds > 0
    target = _zeros_like(ref)
    storage.load(target, url, storage_options=opts)
    _assert_same(target, ref)


@pytest.fixture(params=["local", "s3"])
def durable_backend(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict | None]:
    """The backends where an interrupted write can be undone (memory:// publishes a file the
    moment it is opened, so it has no such guarantee to test)."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    opts = request.getfixturevalue("s3_endpoint")
    return request.getfixturevalue("s3_bucket_url"), dict(opts)


def test_a_write_that_fails_half_way_leaves_no_object(
    durable_backend: tuple[str, dict | None],
) -> None:
    """On an object store, closing an upload completes it: a write that raises must discard
    the upload, or a partial manifest would look like a committed step."""
    from ftsdp.storage.io._fs import Store

    url, opts = durable_backend
    store = Store(url, opts, storage.IOOptions(max_attempts=1))

    def produce(f: Any) -> None:
        f.write(b"half of it")
        raise RuntimeError("the writer died")

    with pytest.raises(RuntimeError, match="the writer died"):
        store.write("step-1/manifest.json", produce)
    fs, root = _fs(url, opts)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/step-1/manifest.json")
    assert storage.list_steps(url, storage_options=opts) == []
