"""One process saving every rank's step (the snapshot persister's way, ``RootForRanks``): a
step that fails before its commit leaves nothing it placed in the root, neither written objects
nor hard links to the ranks' files (which would keep those files' old bytes alive); one that
committed keeps its objects whatever fails after."""

from __future__ import annotations

import os

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving import RootForRanks, _shares, describe, leaf_rows, object_checksums

WORLD = 2


def _rows() -> list:
    """Rank r holds its own tensor ``t{r}`` (3 x 4 float32)."""
    rows = []
    for r in range(WORLD):
        leaves, _ = describe({f"t{r}": torch.zeros(3, 4)})
        rows.append(leaf_rows(leaves))
    return rows


def _laid_out(obj) -> bytearray:
    """Object ``obj``'s whole file: its header, then zeros (the tensors' values)."""
    data = bytearray(obj.size)
    data[: len(obj.head)] = obj.head
    return data


def _save(root: RootForRanks, step: int, via_links: str | None = None) -> None:
    with root.begin(step, _rows(), storage.SaveOptions()) as job:
        named = []
        for r in range(WORLD):
            crcs = {}
            for i, obj in enumerate(job.objects(r)):
                data = _laid_out(obj)
                if via_links is None:
                    crcs[obj.name] = job.write(obj, memoryview(data), True)
                    continue
                path = os.path.join(via_links, f"r{r}-{i}")
                with open(path, "wb") as f:
                    f.write(data)
                crcs[obj.name] = object_checksums(obj, memoryview(data), 1 << 20)
                job.link(obj, path)
            named.append(crcs)
        job.commit(named, [{} for _ in range(WORLD)])


def _entries(url: str) -> list[str]:
    return sorted(os.listdir(url)) if os.path.isdir(url) else []


def test_a_failed_write_removes_the_objects_already_written(tmp_path, monkeypatch) -> None:
    url = str(tmp_path / "root")
    root = RootForRanks(url)
    _save(root, 1)
    before = _entries(url)
    real, calls = Store._write_once, []

    def second_fails(self, rel, produce):
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, rel, produce)

    monkeypatch.setattr(Store, "_write_once", second_fails)
    with pytest.raises(OSError, match="No space"):
        _save(root, 2)
    monkeypatch.setattr(Store, "_write_once", real)
    assert _entries(url) == before  # no step-2 directory: the first object went again
    _save(root, 2)  # the retry commits
    assert storage.list_steps(url) == [1, 2]
    assert torch.equal(storage.load_state_dict(url, step=2)["t1"], torch.zeros(3, 4))


def test_a_failed_commit_removes_its_links_and_leaves_the_files(tmp_path, monkeypatch) -> None:
    url, files = str(tmp_path / "memory"), tmp_path / "slots"
    files.mkdir()
    root = RootForRanks(url)

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_shares, "commit", refuse)
    with pytest.raises(OSError, match="No space"):
        _save(root, 3, via_links=str(files))
    assert _entries(url) == []  # no step directory of links
    slot_files = sorted(files.iterdir())
    assert slot_files and all(f.stat().st_nlink == 1 for f in slot_files)


def test_a_failure_after_the_commit_keeps_the_step(tmp_path, monkeypatch) -> None:
    url, files = str(tmp_path / "memory"), tmp_path / "slots"
    files.mkdir()
    real = _shares.commit

    def commit_then_fail(*args, **kwargs):
        real(*args, **kwargs)
        raise OSError(5, "Input/output error (after the manifest)")

    monkeypatch.setattr(_shares, "commit", commit_then_fail)
    with pytest.raises(OSError, match="after the manifest"):
        _save(RootForRanks(url), 4, via_links=str(files))
    assert storage.list_steps(url) == [4]
    assert torch.equal(storage.load_state_dict(url, step=4)["t0"], torch.zeros(3, 4))
