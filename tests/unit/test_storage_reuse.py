"""Overwriting retired objects (``SaveOptions.reuse_retired``; [Note: overwriting a retired object]
in storage/_fs.py): a save takes the objects of the step retention just retired as its own
files, but never one that anyone else can still see: a reader holding it open or mapped, a hard
link of the user's, a link put in its place. What is saved and loaded stays bitwise the state.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import zlib

import pytest
import torch

from ftsdp import storage
from ftsdp.storage._fs import Store
from ftsdp.trainer import CheckpointManager

pytestmark = pytest.mark.timeout(120)
REUSE = storage.SaveOptions(reuse_retired=True)


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every retired object a save tried to take, and whether it was taken."""
    seen: list[tuple[str, bool]] = []
    real = Store._take_retired

    def watch(self: Store, rel: str, tmp: str):
        f = real(self, rel, tmp)
        seen.append((rel, f is not None))
        return f

    monkeypatch.setattr(Store, "_take_retired", watch)
    return seen


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 200, generator=g), "b": torch.randn(7, generator=g)}


def _objects(root: pathlib.Path, step: int) -> list[pathlib.Path]:
    manifest = storage.read_manifest(str(root), step)
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
        storage.save(_state(step), str(root), step, keep_last=2, options=REUSE)
        assert torch.equal(_load(root)["w"], _state(step)["w"])
    # step 1 retired at the commit of 3, its object overwritten by 4; and so on
    assert [ok for _, ok in taken] == [True, True, True]
    assert [rel.split("/")[0] for rel, _ in taken] == ["step-1", "step-2", "step-3"]
    # the retired step waiting to be taken is torn (no manifest); every committed step checks
    assert _dirs(root) == ["step-4", "step-5", "step-6"]
    assert not (root / "step-4" / "manifest.json").exists()
    report = storage.verify(str(root))
    assert report.checked == [5, 6] and not report.problems
    for step in (5, 6):
        loaded = _load(root, step)
        assert all(torch.equal(loaded[k], v) for k, v in _state(step).items())
    # the next retention (here gc's) removes what no save took
    storage.apply_retention(str(root), keep_last=2)
    assert _dirs(root) == ["step-5", "step-6"]


def test_a_smaller_object_leaves_no_tail_of_the_old_one(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    big = {"w": torch.randn(500, 500)}
    for step in (1, 2):
        storage.save(big, str(root), step, keep_last=1, options=REUSE)
    small = {"w": torch.arange(10.0)}
    storage.save(small, str(root), 3, keep_last=1, options=REUSE)
    assert [ok for _, ok in taken] == [True]
    (obj,) = _objects(root, 3)
    assert obj.stat().st_size == storage.read_manifest(str(root), 3).objects[obj.name]
    out = {"w": torch.empty(10)}
    storage.load(out, str(root))
    assert torch.equal(out["w"], small["w"])
    assert not storage.verify(str(root)).problems


def _save_step_1(root: pathlib.Path) -> list[pathlib.Path]:
    """Save step 1 (keep_last=1: the save of step 2 retires it); its objects."""
    storage.save(_state(1), str(root), 1, keep_last=1, options=REUSE)
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
        storage.save(_state(2), str(root), 2, keep_last=1, options=REUSE)
        storage.save(_state(3), str(root), 3, keep_last=1, options=REUSE)
        assert taken == [(f"step-1/{obj.name}", False)]  # deleted, as retention would have
        assert not obj.exists()
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
    storage.save(_state(2), str(root), 2, keep_last=1, options=REUSE)
    storage.save(_state(3), str(root), 3, keep_last=1, options=REUSE)
    assert taken == [(f"step-1/{obj.name}", False)]
    assert zlib.crc32(backup.read_bytes()) == crc and os.stat(backup).st_nlink == 1


def test_a_link_put_in_place_of_a_retired_object_is_never_followed(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, keep_last=1, options=REUSE)  # retires step 1
    assert obj.exists() and not (root / "step-1" / "manifest.json").exists()
    precious = tmp_path / "precious.bin"
    precious.write_bytes(b"the user's own bytes" * 1000)
    obj.unlink()
    obj.symlink_to(precious)
    storage.save(_state(3), str(root), 3, keep_last=1, options=REUSE)
    assert [ok for _, ok in taken] == [False]  # not a regular file: left as it is
    assert precious.read_bytes() == b"the user's own bytes" * 1000
    assert obj.is_symlink()  # not ours to delete either
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_a_file_that_cannot_be_proven_unseen_is_written_anew(tmp_path, monkeypatch) -> None:
    """Without leases (another OS, a network filesystem) nothing is overwritten."""
    monkeypatch.setattr("ftsdp.storage._fs._sole_opener", lambda fd: False)
    root = tmp_path / "ckpt"
    (obj,) = _save_step_1(root)
    storage.save(_state(2), str(root), 2, keep_last=1, options=REUSE)
    ino = obj.stat().st_ino
    fd = os.open(obj, os.O_RDONLY)  # kept open: its inode cannot be recycled by the filesystem
    try:
        storage.save(_state(3), str(root), 3, keep_last=1, options=REUSE)
        assert all(p.stat().st_ino != ino for p in _objects(root, 3))
        assert os.fstat(fd).st_nlink == 0  # deleted, as retention would have
    finally:
        os.close(fd)
    assert torch.equal(_load(root)["w"], _state(3)["w"])


def test_a_failed_write_into_a_retired_object_retries_into_a_new_file(
    tmp_path, monkeypatch, taken
) -> None:
    root = tmp_path / "ckpt"
    _save_step_1(root)
    storage.save(_state(2), str(root), 2, keep_last=1, options=REUSE)
    real, failures = Store._write_once, []

    def flaky(self: Store, rel: str, produce) -> None:
        if rel.endswith(".safetensors") and not failures:
            failures.append(rel)

            def broken(f) -> None:
                f.write(b"partial")
                raise ConnectionError("transient")

            inner, produce.produce = produce.produce, broken
            try:
                return real(self, rel, produce)
            finally:
                produce.produce = inner
        return real(self, rel, produce)

    monkeypatch.setattr(Store, "_write_once", flaky)
    storage.save(_state(3), str(root), 3, keep_last=1, options=REUSE)
    assert failures and [ok for _, ok in taken] == [True]
    assert torch.equal(_load(root)["w"], _state(3)["w"])
    assert not [p for p in (root / "step-3").iterdir() if ".tmp-" in p.name]


def test_a_bare_save_does_not_reuse_by_default(tmp_path, taken) -> None:
    root = tmp_path / "ckpt"
    for step in range(1, 5):
        storage.save(_state(step), str(root), step, keep_last=2)
    assert taken == [] and _dirs(root) == ["step-3", "step-4"]


def test_checkpoint_manager_reuses_and_close_leaves_only_kept_steps(tmp_path, taken) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = tmp_path / "ckpt"
    ckpt = CheckpointManager(str(root), model, opt, every_steps=1, keep_last=2)
    assert ckpt.save_options.reuse_retired is True
    for step in range(1, 7):
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, {"step": step})
    ckpt.close()
    assert len(taken) == 3 and all(ok for _, ok in taken)
    assert _dirs(root) == ["step-5", "step-6"]  # close removed the step left to be taken
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    again = CheckpointManager(str(root), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    assert again.resume({"step": 0}).step == 6
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved.items())
    again.close()


def test_concurrent_readers_never_see_an_overwritten_object(tmp_path) -> None:
    """The short version of ``python -m ftsdp.tools.stress_reuse``: a save every few
    milliseconds, each retiring the previous step, while two processes load and hold mappings.
    (With the lease check disabled its longer run gets wrong loads and changed mappings.)"""
    from ftsdp.tools.stress_reuse import run

    root = tmp_path / "ckpt"
    root.mkdir()
    totals = run(4.0, 2, str(root))
    assert totals["wrong"] == 0 and totals["changed"] == 0, totals
    assert totals["exact"] > 0 and totals["held"] > 0 and totals["reused"] > 0, totals
