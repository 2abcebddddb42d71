"""Safety of deletion, lineage and commit (docs/format.md, "Threat model"):

- gc and retention delete only what is provably ours: never a folder that merely looks like a
  root, never a step whose manifest is unreadable, nothing behind a link; ``--keep-last 0`` is
  refused;
- a save never goes behind newer committed steps (refused up front, or ``discard_newer``), so it
  never deletes itself and the newest step a resume sees is the one just saved;
- one writer per step: the manifest is created exclusively; of two writers exactly one commits,
  the other fails and removes its objects; a stale writer cannot commit past a newer step.

Local directory and S3 (SeaweedFS) where the store matters.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import pathlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import fsspec
import pytest
import torch

from ftsdp import storage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving._commit import CommitConflictError, _wait_for_commit
from ftsdp.tools.ckpt import main as cli
from tests.s3_fixture import new_bucket_url

pytestmark = pytest.mark.timeout(180)
SMALL = storage.SaveOptions(checksum_block_bytes=64, object_bytes=3000)


@pytest.fixture(scope="module")
def bucket(s3_endpoint: dict[str, Any]) -> str:
    """``s3://<bucket>``, one for this module's S3 tests, each under a prefix of its own
    (``s3_url``): a fresh SeaweedFS bucket costs about a second and a half before its first
    concurrent writes return (it is created, then grows its volume), a dozen times here. One
    small write first grows the volume alone, the quicker way."""
    import s3fs

    url = new_bucket_url(s3_endpoint).removesuffix("/ckpt")
    s3fs.S3FileSystem(**s3_endpoint).pipe_file(f"{url.removeprefix('s3://')}/warm", b"warm")
    return url


@pytest.fixture
def s3_url(bucket: str) -> Iterator[str]:
    """``s3://<bucket>/<fresh prefix>/ckpt``: an empty root, as a fresh bucket's would be."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield f"{bucket}/{uuid.uuid4().hex[:12]}/ckpt"
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> tuple[str, dict | None]:
    """``(url, storage_options)`` of an empty root on a local disk and on S3 (SeaweedFS)."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3_url"), dict(request.getfixturevalue("s3_endpoint"))


def _fs(url: str, opts: dict | None) -> tuple[Any, str]:
    fs, root = fsspec.core.url_to_fs(url, **(opts or {}))
    return fs, root.rstrip("/")


def _put(url: str, opts: dict | None, rel: str, data: bytes) -> None:
    fs, root = _fs(url, opts)
    fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(f"{root}/{rel}", data)
    fs.invalidate_cache()


def _tree(url: str, opts: dict | None) -> dict[str, bytes]:
    """Every file under the root and its bytes."""
    fs, root = _fs(url, opts)
    fs.invalidate_cache()
    return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}


def _state(value: float, n: int = 2000) -> dict[str, Any]:
    return {"w": torch.full((n,), float(value)), "b": torch.arange(7) * int(value), "step": value}


def _load(url: str, opts: dict | None, step: int | None = None, n: int = 2000) -> dict[str, Any]:
    target = {"w": torch.zeros(n), "b": torch.zeros(7, dtype=torch.int64), "step": None}
    storage.load(target, url, step, storage_options=opts)
    return target


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def _gc(*argv: str) -> tuple[int, str, str]:
    import io

    out, err = io.StringIO(), io.StringIO()
    return cli(["gc", *argv], out=out, err=err), out.getvalue(), err.getvalue()


def _opts_argv(opts: dict | None) -> list[str]:
    return [a for k, v in (opts or {}).items() for a in ("-o", f"{k}={v}")]


# -- 2. gc and retention delete only what is provably ours ---------------------------------------


def test_gc_leaves_a_folder_that_only_looks_like_a_root(backend) -> None:
    """step-1/, step-2/ of a user's own files and an unrelated step-3/manifest.json: the old gc
    took step 3 for the newest commit and deleted steps 1 and 2."""
    url, opts = backend
    _put(url, opts, "step-1/notes.txt", b"mine")
    _put(url, opts, "step-2/data.bin", b"also mine")
    _put(url, opts, "step-3/manifest.json", json.dumps({"name": "my experiment"}).encode())
    before = _tree(url, opts)
    for extra in ([], ["--keep-last", "1"]):
        code, out, err = _gc(url, *extra, *_opts_argv(opts))
        assert code == 0, err
        assert "removed steps none" in out and "kept torn steps [1, 2]" in out
        assert "step-3: left alone" in out and "not a committed step of this format" in out
    assert _tree(url, opts) == before
    assert storage.catalog.apply_retention(url, keep_last=1, storage_options=opts) == []
    assert _tree(url, opts) == before


def test_an_unreadable_manifest_never_counts_toward_keep_last(backend, caplog) -> None:
    """Step 2's manifest is garbage: the old gc kept it as the newest and deleted step 1, the
    only good step."""
    url, opts = backend
    storage.save(_state(1), url, step=1, storage_options=opts, options=SMALL)
    storage.save(_state(2), url, step=2, storage_options=opts, options=SMALL)
    _put(url, opts, "step-2/manifest.json", b"{not json")
    before = _tree(url, opts)
    code, out, err = _gc(url, "--keep-last", "1", *_opts_argv(opts))
    assert code == 0, err
    assert "removed steps none" in out and "kept steps [1]" in out
    assert "step-2: left alone" in out and "not a committed step of this format" in out
    assert _tree(url, opts) == before
    report = storage.catalog.collect_garbage(url, keep_last=1, storage_options=opts)
    assert report.removed_steps == [] and report.kept_steps == [1] and report.left_alone
    # Retention after a save: the unreadable step neither counts nor goes.
    # Logged (an operational event), not a warnings.warn.
    with caplog.at_level(logging.WARNING, logger="ftsdp.storage.format._steps"):
        storage.save(
            _state(3), url, step=3, storage_options=opts, options=replace(SMALL, keep_last=1)
        )
    assert "retention left alone:" in caplog.text and "step-2: left alone" in caplog.text
    tree = _tree(url, opts)
    assert not any(p.startswith("step-1/") for p in tree)
    assert {p: b for p, b in tree.items() if p.startswith("step-2/")} == {
        p: b for p, b in before.items() if p.startswith("step-2/")
    }
    _same(_load(url, opts, 3), _state(3))
    caplog.clear()  # said once: the next saves of this process to the root do not repeat it
    with caplog.at_level(logging.WARNING, logger="ftsdp.storage.format._steps"):
        for step in (4, 5):
            storage.save(
                _state(step), url, step, storage_options=opts, options=replace(SMALL, keep_last=1)
            )
    assert "left alone" not in caplog.text
    assert storage.list_steps(url, storage_options=opts) == [2, 5]  # retention still ran


def test_torn_and_stray_files_are_ours_only_by_name(backend) -> None:
    """A torn attempt holding only this format's names is cleaned; one holding anything else,
    and foreign files inside a kept step, stay (and are reported)."""
    url, opts = backend
    for step in (2, 3, 4):
        storage.save(_state(step), url, step=step, storage_options=opts, options=SMALL)
    _put(url, opts, "step-0/rank00000-000-aaaaaaaa.safetensors", b"torn")
    _put(url, opts, "step-0/_done-aaaaaaaa-rank00001.json", b"{}")
    _put(url, opts, "step-1/rank00000-000-aaaaaaaa.safetensors", b"torn")
    _put(url, opts, "step-1/notes.txt", b"a user's file in a torn-looking dir")
    _put(url, opts, "step-2/rank00000-000-bbbbbbbb.safetensors.tmp-0123abcd", b"temp")
    _put(url, opts, "step-2/README", b"a user's note in a step")
    _put(url, opts, "step-3/rank00001-000-cccccccc.safetensors", b"stray")
    _put(url, opts, "step-3/keep.me", b"user file")
    before = _tree(url, opts)
    report = storage.catalog.collect_garbage(url, keep_last=2, grace_s=0, storage_options=opts)
    assert report.removed_steps == [0, 2] and report.kept_steps == [3, 4]
    tree = _tree(url, opts)
    assert not any(p.startswith("step-0/") for p in tree)
    assert {p: b for p, b in tree.items() if p.startswith("step-1/")} == {
        p: b for p, b in before.items() if p.startswith("step-1/")
    }
    assert sorted(p for p in tree if p.startswith("step-2/")) == ["step-2/README"]
    assert "step-3/keep.me" in tree and "step-3/rank00001-000-cccccccc.safetensors" not in tree
    for name in ("step-1: left alone", "notes.txt", "README", "keep.me"):
        assert any(name in w for w in report.left_alone), (name, report.left_alone)
    _same(_load(url, opts, 3), _state(3))


def test_nothing_behind_a_link_is_touched(tmp_path: pathlib.Path) -> None:
    """A step directory that is a link to a folder outside the root: the old gc deleted that
    folder's manifest.json. Links are skipped, never followed."""
    url = str(tmp_path / "ckpt")
    for step in (1, 2, 3):
        storage.save(_state(step), url, step=step, options=SMALL)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_bytes((tmp_path / "ckpt/step-1/manifest.json").read_bytes())
    (outside / "precious.txt").write_text("not a checkpoint")
    os.symlink(outside, tmp_path / "ckpt" / "step-0")
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"v" * 10)
    os.symlink(victim, tmp_path / "ckpt/step-1/rank00000-000-dddddddd.safetensors")
    code, out, err = _gc(url, "--keep-last", "1")
    assert code == 0, err
    assert "step-0: a link; never followed" in out
    assert sorted(p.name for p in outside.iterdir()) == ["manifest.json", "precious.txt"]
    assert victim.read_bytes() == b"v" * 10
    assert storage.catalog.collect_garbage(url, dry_run=True).kept_steps == [3]
    assert (tmp_path / "ckpt/step-1").is_dir()  # the link in it stays, so the directory does
    assert [p.name for p in (tmp_path / "ckpt/step-1").iterdir()] == [
        "rank00000-000-dddddddd.safetensors"
    ]
    with pytest.raises(FileExistsError, match="is a link"):
        storage.save(_state(9), str(tmp_path / "ckpt"), step=0, options=SMALL)


def test_keep_last_0_is_refused(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "ckpt")
    for step in (1, 2):
        storage.save(_state(step), url, step=step, options=SMALL)
    code, out, err = _gc(url, "--keep-last", "0")
    assert code == 2 and out == "" and "--keep-last" in err and ">= 1" in err
    with pytest.raises(ValueError, match="keep_last=0"):
        storage.catalog.collect_garbage(url, keep_last=0)
    with pytest.raises(ValueError, match="keep_last=0"):
        storage.catalog.apply_retention(url, keep_last=0)
    assert storage.list_steps(url) == [1, 2]


# -- 3. lineage: a save never goes behind newer committed steps ----------------------------------


def test_a_save_behind_newer_steps_is_refused_or_discards_them(backend) -> None:
    """100, 200, 300 committed; a run resumed from 100 saves 250 with keep_last=1. The old save
    reported success and retention deleted 250; the next resume loaded 300."""
    url, opts = backend
    for step in (100, 200, 300):
        storage.save(_state(step), url, step=step, storage_options=opts, options=SMALL)
    before = _tree(url, opts)
    keep = storage.SaveOptions(keep_last=1)
    with pytest.raises(storage.CheckpointError, match=r"newer than it exist: \[300\]") as e:
        storage.save(_state(250), url, step=250, options=keep, storage_options=opts)
    assert "SaveOptions(discard_newer=True)" in str(e.value)
    assert _tree(url, opts) == before  # refused before anything was written
    with pytest.raises(FileExistsError, match="step 200 is already committed"):
        storage.save(_state(250), url, step=200, storage_options=opts)

    discard = storage.SaveOptions(keep_last=1, discard_newer=True)
    storage.save(_state(250), url, step=250, options=discard, storage_options=opts)
    assert storage.list_steps(url, storage_options=opts) == [250]
    _same(_load(url, opts), _state(250))
    assert _fs(url, opts)[0].cat_file(f"{_fs(url, opts)[1]}/latest") == b"250\n"
    assert sorted({p.split("/")[0] for p in _tree(url, opts)}) == ["latest", "step-250"]


def test_discard_newer_replaces_an_abandoned_commit_of_the_same_step(backend) -> None:
    url, opts = backend
    for step in (1, 2, 3):
        storage.save(_state(step), url, step=step, storage_options=opts, options=SMALL)
    discard = replace(SMALL, discard_newer=True)
    storage.save(_state(20), url, step=2, storage_options=opts, options=discard)
    assert storage.list_steps(url, storage_options=opts) == [1, 2]
    _same(_load(url, opts, 2), _state(20))
    manifest = storage.catalog.read_manifest(url, 2, storage_options=opts)
    names = sorted(p.rsplit("/", 1)[-1] for p in _tree(url, opts) if p.startswith("step-2/"))
    assert names == sorted(["manifest.json", *manifest.objects])  # old objects gone


# -- 4. one writer per step ----------------------------------------------------------------------


@pytest.fixture(params=["local", "memory", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "root"), None)
    if request.param == "memory":
        return Store(f"memory://excl-{uuid.uuid4().hex[:8]}", None)
    s3 = dict(request.getfixturevalue("s3_endpoint"))
    return Store(request.getfixturevalue("s3_url"), s3)


def test_write_exclusive_creates_only_once(any_store: Store) -> None:
    """Local: a hard link; S3: ``If-None-Match: *`` (the server answers the second create with 412)."""
    any_store.write_exclusive("step-1/manifest.json", b"first")
    with pytest.raises(FileExistsError):
        any_store.write_exclusive("step-1/manifest.json", b"second")
    assert any_store.read("step-1/manifest.json") == b"first"
    assert list(any_store.listdir("step-1")) == ["manifest.json"]  # no temporary file left
    # 11 MiB in 5 MiB parts: a multipart upload on S3, the condition sits on its completion.
    parts = Store(
        any_store.url, any_store.fs.storage_options, storage.IOOptions(part_bytes=5 << 20)
    )
    big = os.urandom(11 << 20)
    parts.write_exclusive("big", big)
    with pytest.raises(FileExistsError):
        parts.write_exclusive("big", b"x" * (11 << 20))
    assert parts.read("big") == big


def _writers() -> Any:
    """The writers' start method: a fork server that imported torch, ftsdp and this module once
    for every writer of the session (it stays); a spawned writer spends seconds importing them.
    Not a fork of this process: its S3 client's event loop (epoll) would be the writers' too,
    and a writer that drops the inherited client takes its connections off this process's loop
    (this process's next S3 request then waits seconds for its answer)."""
    multiprocessing.set_forkserver_preload(["torch", "ftsdp.storage", "s3fs", __name__])
    return multiprocessing.get_context("forkserver")


def _writer(url: str, opts: dict | None, value: float, barrier: Any, out: Any) -> None:
    """One of two processes saving step 5: both pass every check, then meet right before
    creating the manifest, so that the exclusive create decides."""
    real = getattr(Store, "write_exclusive", None)  # (code without it: both just save)

    def meet_then_create(self: Store, rel: str, data: bytes) -> None:
        if rel.endswith("manifest.json"):
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(60)
        real(self, rel, data)

    if real is not None:
        Store.write_exclusive = meet_then_create  # type: ignore[method-assign]
    try:
        barrier.wait(60)  # start together
        storage.save(_state(value, 20000), url, step=5, storage_options=opts, options=SMALL)
        out.put((value, "ok"))
    except Exception as e:
        out.put((value, f"{type(e).__name__}: {e}"))


def test_two_writers_of_one_step_exactly_one_wins(backend) -> None:
    """Two processes save step 5 to one root at once. The old code let both report success and
    kept whichever manifest was written last (the other's state silently lost)."""
    url, opts = backend
    storage.save(_state(1, 20000), url, step=1, storage_options=opts, options=SMALL)
    ctx = _writers()
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, opts, v, barrier, out)) for v in (10, 20)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    winners = [v for v, r in results.items() if r == "ok"]
    assert len(winners) == 1, results
    (loser,) = set(results) - set(winners)
    assert results[loser].startswith("CommitConflictError") and "another writer" in results[loser]
    _same(_load(url, opts, 5, 20000), _state(winners[0], 20000))
    manifest = storage.catalog.read_manifest(url, 5, storage_options=opts)
    names = sorted(p.rsplit("/", 1)[-1] for p in _tree(url, opts) if p.startswith("step-5/"))
    assert names == sorted(["manifest.json", *manifest.objects])  # the loser's objects went


def test_a_rank_of_the_losing_writer_does_not_report_success(tmp_path: pathlib.Path) -> None:
    """Ranks > 0 used to return as soon as any manifest existed: another writer's too."""
    store = Store(str(tmp_path), None)
    store.write_bytes("step-5/manifest.json", json.dumps({"attempt": "aaaaaaaa"}).encode())
    with pytest.raises(CommitConflictError, match="attempt aaaaaaaa"):
        _wait_for_commit(store, 5, "bbbbbbbb", 1, 5.0, None)
    _wait_for_commit(store, 5, "aaaaaaaa", 1, 5.0, None)  # its own: committed


def test_a_conflict_with_an_unreadable_winner_says_so_and_removes_its_objects(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other writer's manifest appears between the check and the create, and cannot be
    read: the loser still fails with CommitConflictError, names no "attempt None", and takes
    away only its own objects."""
    url = str(tmp_path / "root")
    real = Store.write_exclusive

    def raced(self: Store, rel: str, data: bytes) -> None:
        if rel == "step-3/manifest.json":
            self.write_bytes(rel, b"\x00 not json")  # the other writer's, damaged
            raise FileExistsError(rel)
        real(self, rel, data)

    monkeypatch.setattr(Store, "write_exclusive", raced)
    with pytest.raises(CommitConflictError, match="its manifest could not be read") as err:
        storage.save(_state(3), url, step=3, options=SMALL)
    assert "None" not in str(err.value)
    assert os.listdir(tmp_path / "root" / "step-3") == ["manifest.json"]  # the other's stays


def _copy_step(src: str, dst: str, opts: dict | None, step: int) -> None:
    """Put a committed step of root ``src`` into root ``dst`` as another writer would: its
    objects, then its manifest."""
    fs, a = _fs(src, opts)
    b = _fs(dst, opts)[1]
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{a}/step-{step}", detail=False))
    fs.makedirs(f"{b}/step-{step}", exist_ok=True)
    for name in sorted(names, key=lambda n: n == "manifest.json"):
        fs.pipe_file(f"{b}/step-{step}/{name}", fs.cat_file(f"{a}/step-{step}/{name}"))
    fs.invalidate_cache()


@pytest.mark.parametrize("meanwhile", [[6], [8], [6, 8]])
def test_a_stale_writer_cannot_commit_past_the_new_timeline(
    backend, monkeypatch: pytest.MonkeyPatch, meanwhile: list[int]
) -> None:
    """A rank of an earlier incarnation planned step 6, then stopped; the restarted job
    committed ``meanwhile``; the stale rank resumes and tries to commit. The old code let it
    overwrite step 6's manifest, or commit 6 next to a newer timeline."""
    url, opts = backend
    other = url + "-new"
    for step in (2, 4):
        storage.save(_state(step), url, step=step, storage_options=opts, options=SMALL)
    for step in meanwhile:  # the new incarnation's steps, written elsewhere first
        storage.save(_state(step + 100), other, step=step, storage_options=opts, options=SMALL)
    gate, writing, real = threading.Event(), threading.Event(), Store._write_once

    def gated(self: Store, rel: str, produce: Any) -> None:
        if rel.startswith("step-6/") and rel.endswith(".safetensors"):
            writing.set()  # planned: it writes its objects now
            assert gate.wait(60)
        real(self, rel, produce)

    monkeypatch.setattr(Store, "_write_once", gated)
    stale = storage.save(
        _state(6), url, step=6, async_save=True, storage_options=opts, options=SMALL
    )
    assert writing.wait(60)  # the plan runs in the background: the stale rank stops after it
    for step in meanwhile:
        _copy_step(other, url, opts, step)
    gate.set()
    with pytest.raises(CommitConflictError, match="another writer"):
        stale.wait()
    assert storage.list_steps(url, storage_options=opts) == sorted([2, 4, *meanwhile])
    for step in meanwhile:
        _same(_load(url, opts, step), _state(step + 100))
    attempt = None
    tree = _tree(url, opts)
    if 6 in meanwhile:
        manifest = storage.catalog.read_manifest(url, 6, storage_options=opts)
        attempt = manifest.attempt
    leftovers = [p for p in tree if p.startswith("step-6/") and p != "step-6/manifest.json"]
    assert all(attempt and attempt in p for p in leftovers), leftovers  # only the winner's


def test_a_writer_that_committed_next_to_a_newer_commit_backs_out(
    backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer commits step 8 between this save's last check and its create of step 6's
    manifest: this save sees it right after and takes its commit back."""
    url, opts = backend
    other = url + "-new"
    storage.save(_state(4), url, step=4, storage_options=opts, options=SMALL)
    storage.save(_state(108), other, step=8, storage_options=opts, options=SMALL)
    real = Store.write_exclusive

    def create_after_the_other(self: Store, rel: str, data: bytes) -> None:
        if rel == "step-6/manifest.json":
            _copy_step(other, url, opts, 8)
        real(self, rel, data)

    monkeypatch.setattr(Store, "write_exclusive", create_after_the_other)
    with pytest.raises(CommitConflictError, match=r"steps \[8\] were committed"):
        storage.save(_state(6), url, step=6, storage_options=opts, options=SMALL)
    assert storage.list_steps(url, storage_options=opts) == [4, 8]
    assert not any(p.startswith("step-6/") for p in _tree(url, opts))


@pytest.mark.parametrize("how", ["open", "mapped", "linked"])
def test_a_reader_or_a_link_keeps_the_bytes_of_a_retired_step(tmp_path, how) -> None:
    """Objects are immutable: a save writes new files and retention deletes old ones, so a
    reader holding an object open or mapped, or a user's hard link to it (a ``cp -al``
    backup), keeps the bytes it had while later saves retire its step (on shared memory, where
    there is one)."""
    import mmap
    import shutil
    import tempfile
    import zlib

    base = "/dev/shm" if Store("/dev/shm", None).tmpfs else str(tmp_path)
    root = pathlib.Path(tempfile.mkdtemp(prefix="ftsdp-test-retired-", dir=base))

    def state(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g)}

    try:
        storage.save(state(1), str(root), 1, options=storage.SaveOptions(keep_last=1))
        (name,) = storage.catalog.read_manifest(str(root), 1).objects
        obj = root / "step-1" / name
        before = obj.read_bytes()
        fd = os.open(obj, os.O_RDONLY)
        held = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if how == "mapped" else None
        backup = root / "backup.safetensors"  # not a name of the format: retention leaves it
        if how == "linked":
            os.link(obj, backup)
        try:
            for step in (2, 3):
                h = storage.save(
                    state(step),
                    str(root),
                    step,
                    options=storage.SaveOptions(keep_last=1),
                    async_save=True,
                )
                h.wait()
            assert not obj.exists() and storage.list_steps(str(root)) == [3]
            assert sorted(p.name for p in root.glob("step-*")) == ["step-3"]  # nothing left
            if how == "linked":
                now = backup.read_bytes()
                assert os.stat(backup).st_nlink == 1
            else:
                now = held[:] if held is not None else os.pread(fd, len(before) + 1, 0)
            assert zlib.crc32(now) == zlib.crc32(before) and now == before
        finally:
            if held is not None:
                held.close()
            os.close(fd)
        out = {"w": torch.empty(300, 200), "b": torch.empty(7)}
        storage.load(out, str(root))
        assert all(torch.equal(out[k], v) for k, v in state(3).items())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_filesystem_type_is_the_one_of_the_roots_device() -> None:
    """``Store.tmpfs`` (a deferred save writes a tmpfs root from the live tensors) reads the
    mount table's filesystem of the root's device, for paths not created yet too."""
    from ftsdp.storage.io import _local

    assert _local._mount_type("/dev/shm/not/there/yet") == "tmpfs"
    assert _local._mount_type("/proc/self") == "proc"
    assert Store("memory://x", None).tmpfs is False


def test_a_step_another_writer_replaced_is_discarded_as_it_is_now(backend) -> None:
    """This process committed step 3 (its saves remember that commit); another writer then
    replaced step 3 with its own commit. A save of step 2 that discards the newer steps must
    discard the replacement: what a saver remembers never decides what it deletes."""
    url, opts = backend
    other = url + "-other"
    for step in (1, 3):
        storage.save(_state(step), url, step=step, storage_options=opts, options=SMALL)
    storage.save(_state(103), other, step=3, storage_options=opts, options=SMALL)
    fs, root = _fs(url, opts)
    fs.rm(f"{root}/step-3", recursive=True)
    fs.invalidate_cache()
    _copy_step(other, url, opts, 3)  # the other writer's commit of step 3
    _same(_load(url, opts, 3), _state(103))
    discard = replace(SMALL, discard_newer=True)
    storage.save(_state(2), url, step=2, storage_options=opts, options=discard)
    assert storage.list_steps(url, storage_options=opts) == [1, 2]
    assert not any(p.startswith("step-3/") for p in _tree(url, opts))
    _same(_load(url, opts, 2), _state(2))
