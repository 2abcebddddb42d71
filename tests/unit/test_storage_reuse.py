"""Overwriting retired objects (``SaveOptions.reuse_retired``; [Note: overwriting a retired object]
in storage/io/_fs.py): on tmpfs a save takes the objects of the step retention just retired as its
own files, but never one that anyone else can still see: a reader holding it open or mapped, a
hard link of the user's, a link or another file put in its place, an open during the overwrite.
What is saved and loaded stays bitwise the state; nothing of the user's is touched.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import pathlib
import shutil
import tempfile
import threading
import time
import zlib
from dataclasses import replace

import pytest
import torch

from ftsdp import storage
from ftsdp.checkpoint import CheckpointManager
from ftsdp.storage.io import _fs as fs_module
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving import _save as save_module

pytestmark = pytest.mark.timeout(120)
REUSE = storage.SaveOptions(reuse_retired=True)


@pytest.fixture
def tmp_path(shm_path: pathlib.Path) -> pathlib.Path:  # type: ignore[override]
    """A fresh directory on tmpfs (host shared memory), where retired objects are reused."""
    return shm_path


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every retired object a save tried to take, and whether it was taken."""
    seen: list[tuple[str, bool]] = []
    real = Store._take_retired

    def watch(self: Store, rel: str, identity: fs_module.Identity, tmp: str):
        f = real(self, rel, identity, tmp)
        seen.append((rel, f is not None))
        return f

    monkeypatch.setattr(Store, "_take_retired", watch)
    return seen


def _on_first_object_write(monkeypatch: pytest.MonkeyPatch, wrap) -> None:
    """Run the first object write of what follows with its bytes' producer wrapped:
    ``wrap(inner)`` returns the producer to use instead (retries get the real one)."""
    real, done = Store._write_once, []

    def first(self: Store, rel: str, produce) -> None:
        if not rel.endswith(".safetensors") or done:
            return real(self, rel, produce)
        done.append(rel)
        inner = produce.produce
        produce.produce = wrap(inner)
        try:
            return real(self, rel, produce)
        finally:
            produce.produce = inner

    monkeypatch.setattr(Store, "_write_once", first)


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g)}


def _objects(root: pathlib.Path, step: int) -> list[pathlib.Path]:
    manifest = storage.catalog.read_manifest(str(root), step)
    return [root / f"step-{step}" / name for name in sorted(manifest.objects)]


def _load(root: pathlib.Path, step: int | None = None) -> dict[str, torch.Tensor]:
    out = {"w": torch.empty(300, 200), "b": torch.empty(7)}
    storage.load(out, str(root), step)
    return out


def _dirs(root: pathlib.Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_a_save_overwrites_the_objects_retention_retired(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    for step in range(1, 7):
        storage.save(_state(step), str(root), step, options=replace(REUSE, keep_last=2))
        assert torch.equal(_load(root)["w"], _state(step)["w"])
    # step 1 retired at the commit of 3, its object overwritten by 4; and so on
    assert [ok for _, ok in taken] == [True, True, True]
    assert [rel.split("/")[0] for rel, _ in taken] == ["step-1", "step-2", "step-3"]
    # the retired step waiting to be taken is torn (no manifest); every committed step checks
    assert _dirs(root) == ["step-4", "step-5", "step-6"]
    assert not (root / "step-4" / "manifest.json").exists()
    report = storage.catalog.verify(str(root))
    assert report.checked == [5, 6] and not report.problems
    for step in (5, 6):
        loaded = _load(root, step)
        assert all(torch.equal(loaded[k], v) for k, v in _state(step).items())
    # the next retention (here gc's) removes what no save took
    storage.catalog.apply_retention(str(root), keep_last=2)
    assert _dirs(root) == ["step-5", "step-6"]


def test_a_smaller_object_leaves_no_tail_of_the_old_one(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    big = {"w": torch.randn(500, 500)}
    for step in (1, 2):
        storage.save(big, str(root), step, options=replace(REUSE, keep_last=1))
    small = {"w": torch.arange(10.0)}
    storage.save(small, str(root), 3, options=replace(REUSE, keep_last=1))
    assert [ok for _, ok in taken] == [True]
    (obj,) = _objects(root, 3)
    assert obj.stat().st_size == storage.catalog.read_manifest(str(root), 3).objects[obj.name]
    out = {"w": torch.empty(10)}
    storage.load(out, str(root))
    assert torch.equal(out["w"], small["w"])
    assert not storage.catalog.verify(str(root)).problems


def _save_step_1(root: pathlib.Path) -> list[pathlib.Path]:
    """Save step 1 (keep_last=1: the save of step 2 retires it); its objects."""
    storage.save(_state(1), str(root), 1, options=replace(REUSE, keep_last=1))
    return _objects(root, 1)


@pytest.mark.parametrize("how", ["open", "mapped"])
def test_a_reader_keeps_the_bytes_it_holds(tmp_path, taken, how) -> None:
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    before = obj.read_bytes()
    fd = os.open(obj, os.O_RDONLY)
    held = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if how == "mapped" else None
    if held is not None:
        os.close(fd)
    try:
        storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
        storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
        assert taken == [(f"step-1/{obj.name}", False)]  # left to retention, which deleted it
        assert not obj.exists() and not (root / "step-1").exists()
        now = held[:] if held is not None else os.pread(fd, len(before) + 1, 0)
        assert now == before
    finally:
        held.close() if held is not None else os.close(fd)
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_a_hard_link_of_the_users_keeps_its_bytes(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    backup = tmp_path / "backup.safetensors"
    os.link(obj, backup)
    crc = zlib.crc32(backup.read_bytes())
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert taken == [(f"step-1/{obj.name}", False)]
    assert zlib.crc32(backup.read_bytes()) == crc and os.stat(backup).st_nlink == 1


def test_a_link_put_in_place_of_a_retired_object_is_never_followed(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))  # retires step 1
    assert obj.exists() and not (root / "step-1" / "manifest.json").exists()
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"the user's own bytes" * 1000)
    obj.unlink()
    obj.symlink_to(precious)
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert [ok for _, ok in taken] == [False]  # not a regular file: left as it is
    assert precious.read_bytes() == b"the user's own bytes" * 1000
    assert obj.is_symlink()  # not ours to delete either
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_a_file_that_cannot_be_proven_unseen_is_written_anew(tmp_path, monkeypatch) -> None:
    """Without leases (another OS, leases disabled) nothing is overwritten."""
    monkeypatch.setattr("ftsdp.storage.io._fs._lease", lambda fd: False)
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    ino = obj.stat().st_ino
    fd = os.open(obj, os.O_RDONLY)  # kept open: its inode cannot be recycled by the filesystem
    try:
        storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
        assert all(p.stat().st_ino != ino for p in _objects(root, 3))
        assert os.fstat(fd).st_nlink == 0  # deleted by retention, as without the option
    finally:
        os.close(fd)
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_another_file_in_place_of_a_retired_object_is_left_alone(tmp_path, taken) -> None:
    """Taken is only the very file this process wrote (device and inode), not a file of the
    same name put there since."""
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    obj.unlink()
    obj.write_bytes(b"someone else's file")
    fd = os.open(obj, os.O_RDONLY)  # to see what becomes of it (also: its inode stays its own)
    try:
        os.close(os.dup(fd))
        ino = os.fstat(fd).st_ino
        storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
        assert [ok for _, ok in taken] == [False]
        assert os.pread(fd, 100, 0) == b"someone else's file"
        assert all(p.stat().st_ino != ino for p in _objects(root, 3))
    finally:
        os.close(fd)


def test_a_retired_step_holding_a_foreign_file_is_not_spared(tmp_path, taken) -> None:
    """Spared objects would stay for good in a torn step retention leaves alone."""
    root = tmp_path / "ckpt"
    _save_step_1(root)
    (root / "step-1" / "NOTES.txt").write_text("mine")
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert [p.name for p in (root / "step-1").iterdir()] == ["NOTES.txt"]
    assert not any(ok for _, ok in taken)  # its objects were deleted: nothing to take
    assert _dirs(root) == ["step-1", "step-2", "step-3"]  # step 2: spared for the next save
    assert not (root / "step-2" / "manifest.json").exists()


@pytest.mark.parametrize("then", ["finishes", "fails"])
def test_an_open_during_the_overwrite_sees_an_empty_file_never_a_mix(
    tmp_path, monkeypatch, taken, then
) -> None:
    """An open that breaks the lease while the object is overwritten (it looked up the old
    name just before the rename) is let through only once the file is empty, whether the
    overwrite then finishes or fails; the save writes its object anew, and the process
    survives the lease break (no SIGIO)."""
    root = tmp_path / "ckpt"
    _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    seen: dict = {}

    def open_and_look(path: str) -> None:  # blocks until the saver gives the lease back
        fd = os.open(path, os.O_RDONLY)
        seen["size"], seen["bytes"] = os.fstat(fd).st_size, os.pread(fd, 64, 0)
        os.close(fd)

    def get_opened(inner):
        def write_then_get_opened(f) -> None:
            inner(f)  # the whole new object, under the lease
            path = os.readlink(f"/proc/self/fd/{f.fileno()}")
            seen["opener"] = threading.Thread(target=open_and_look, args=(path,))
            seen["opener"].start()
            for _ in range(2000):  # until the open has broken the lease
                if fcntl.fcntl(f.fileno(), fcntl.F_GETLEASE) != fcntl.F_WRLCK:
                    break
                time.sleep(0.001)
            if then == "fails":
                raise ConnectionError("transient")

        return write_then_get_opened

    _on_first_object_write(monkeypatch, get_opened)
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    seen["opener"].join(timeout=60)
    assert [ok for _, ok in taken] == [True]
    assert seen["size"] == 0 and seen["bytes"] == b""
    assert torch.equal(_load(root)["w"], _state(3)["w"])
    assert not storage.catalog.verify(str(root)).problems


def test_a_link_made_while_the_file_is_taken_keeps_its_bytes(tmp_path, monkeypatch, taken) -> None:
    """A hard link made between the checks and the rename (a backup running then) does not
    break the lease: the file is put back and the link keeps the old bytes."""
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    before = obj.read_bytes()
    backup = tmp_path / "backup.safetensors"
    real = fs_module._lease

    def lease_then_link(fd: int) -> bool:
        ok = real(fd)
        os.link(os.readlink(f"/proc/self/fd/{fd}"), backup)
        return ok

    monkeypatch.setattr(fs_module, "_lease", lease_then_link)
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert [ok for _, ok in taken] == [False]
    assert backup.read_bytes() == before
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_a_retired_object_changed_since_it_was_written_is_not_taken(tmp_path, taken) -> None:
    """A chmod (or chown, a link, a write) moves the file's ctime: it is no longer the file as
    this process published it."""
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    time.sleep(0.01)
    os.chmod(obj, 0o666)
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert [ok for _, ok in taken] == [False]
    assert _objects(root, 3)[0].stat().st_mode & 0o777 != 0o666  # a new file, not the chmodded
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_a_new_process_spares_nothing(tmp_path, monkeypatch, taken) -> None:
    """After a restart the lane has no saves of its own: retention deletes as always (a spare
    nobody takes would only take room)."""
    root = tmp_path / "ckpt"
    for step in (1, 2):
        storage.save(_state(step), str(root), step, options=replace(REUSE, keep_last=1))
    monkeypatch.setattr(save_module, "_lanes", {})  # what a restarted process starts with
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert _dirs(root) == ["step-3"]  # step 2, another process's, deleted
    storage.save(_state(4), str(root), 4, options=replace(REUSE, keep_last=1))
    assert _dirs(root) == ["step-3", "step-4"]  # step 3, this one's, left for the next save
    assert taken == []


def test_the_filesystem_type_is_the_one_of_the_roots_device() -> None:
    assert fs_module._mount_type("/dev/shm/not/there/yet") == "tmpfs"
    assert fs_module._mount_type("/proc/self") == "proc"
    assert Store("memory://x", None).tmpfs is False


def test_nothing_is_spared_or_reused_off_tmpfs(monkeypatch, taken) -> None:
    """On a disk the option does nothing: retention deletes as always."""
    monkeypatch.setattr(Store, "tmpfs", property(lambda self: False))
    root = pathlib.Path(tempfile.mkdtemp(prefix="ftsdp-test-reuse-", dir="/dev/shm"))
    try:
        for step in range(1, 5):
            storage.save(_state(step), str(root), step, options=replace(REUSE, keep_last=1))
        assert taken == [] and _dirs(root) == ["step-4"]
    finally:
        shutil.rmtree(root)


def test_a_failed_write_into_a_retired_object_retries_into_a_new_file(
    tmp_path, monkeypatch, taken
) -> None:
    root = tmp_path / "ckpt"
    _save_step_1(root)
    storage.save(_state(2), str(root), 2, options=replace(REUSE, keep_last=1))
    failures = []

    def broken(inner):
        def write_partly(f) -> None:
            failures.append(f)
            f.write(b"partial")
            raise ConnectionError("transient")

        return write_partly

    _on_first_object_write(monkeypatch, broken)
    storage.save(_state(3), str(root), 3, options=replace(REUSE, keep_last=1))
    assert failures and [ok for _, ok in taken] == [True]
    assert torch.equal(_load(root)["w"], _state(3)["w"])
    assert not [p for p in (root / "step-3").iterdir() if ".tmp-" in p.name]


def test_a_bare_save_does_not_reuse_by_default(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    for step in range(1, 5):
        storage.save(_state(step), str(root), step, options=storage.SaveOptions(keep_last=2))
    assert taken == [] and _dirs(root) == ["step-3", "step-4"]


def _train(ckpt: CheckpointManager, model: torch.nn.Module, opt, steps: range) -> None:
    for step in steps:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save_to_memory(step, {"step": step})
        if ckpt.due(step):
            ckpt.save(step, {"step": step})


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_checkpoint_manager_reuses_in_its_memory_tier_only(tmp_path, taken) -> None:
    torch.manual_seed(0)
    model, opt = _model()
    durable, memory = tmp_path / "ckpt", tmp_path / "mem"
    ckpt = CheckpointManager(
        str(durable), model, opt, every_steps=1, keep_last=2, memory_url=str(memory)
    )
    _train(ckpt, model, opt, range(1, 7))
    ckpt.wait()
    # the durable saves of steps 1..6 wrote new files; the memory tier's reused them
    assert taken and all(ok for _, ok in taken)
    assert _dirs(durable) == ["step-5", "step-6"]
    ckpt.close()
    assert not memory.exists() or _dirs(memory) == []  # cleared at close


def test_checkpoint_manager_close_leaves_only_kept_steps(tmp_path, taken) -> None:
    torch.manual_seed(0)
    model, opt = _model()
    root = tmp_path / "ckpt"
    ckpt = CheckpointManager(str(root), model, opt, every_steps=1, keep_last=2, save_options=REUSE)
    _train(ckpt, model, opt, range(1, 7))
    ckpt.wait()
    assert _dirs(root) == ["step-4", "step-5", "step-6"]  # step 4: left for a next save
    ckpt.close()
    assert len(taken) == 3 and all(ok for _, ok in taken)
    assert _dirs(root) == ["step-5", "step-6"]  # close removed the step left to be taken
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _model()
    again = CheckpointManager(str(root), fresh, fresh_opt)
    assert again.resume({"step": 0}).step == 6
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    again.close()


def test_concurrent_readers_never_see_an_overwritten_object(tmp_path) -> None:
    """The short version of ``python -m ftsdp.tools.dev.stress_reuse``: a save every few
    milliseconds, each retiring the previous step, while two processes load and hold mappings.
    (With the lease check disabled its longer run gets wrong loads and changed mappings.)"""
    from ftsdp.tools.dev.stress_reuse import run

    root = tmp_path / "ckpt"
    root.mkdir()
    totals = run(4.0, 2, str(root))
    assert totals["wrong"] == 0 and totals["changed"] == 0, totals
    assert totals["exact"] > 0 and totals["held"] > 0 and totals["reused"] > 0, totals


def test_close_after_a_resume_alone_deletes_nothing(tmp_path) -> None:
    """An evaluation script's manager (default keep_last=3) that only resumes must not apply
    its retention to the training run's root (keep_last=10)."""
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = CheckpointManager(str(root), model, opt, every_steps=1, keep_last=10)
    for step in range(1, 7):
        train.save(step, {"step": step})
    train.close()
    assert storage.list_steps(str(root)) == [1, 2, 3, 4, 5, 6]
    model2 = torch.nn.Linear(8, 8)
    evaluation = CheckpointManager(str(root), model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    evaluation.resume({"step": 0})
    evaluation.close()
    assert storage.list_steps(str(root)) == [1, 2, 3, 4, 5, 6]
    assert _dirs(root) == [f"step-{s}" for s in range(1, 7)]


def test_a_long_keep_last_still_reuses(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    for step in range(1, 14):
        storage.save(_state(step), str(root), step, options=replace(REUSE, keep_last=9))
    assert [ok for _, ok in taken] == [True] * 3  # steps 1, 2, 3 retired, taken by 11, 12, 13
    assert storage.list_steps(str(root)) == list(range(5, 14))
