"""An object with another name (a hard link: the persister's memory tier links its reusable
slot files; a ``cp -al`` backup) may be rewritten in place through that name. Readers then read
it into private memory, so that the bytes they copy are the bytes they verified; an object with
one name is still mapped (docs/format.md, "Integrity")."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.conversion import convert
from ftsdp.storage.loading import _reader


def _ref() -> torch.Tensor:
    return torch.randn(64, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[str, Path]:
    """A step of one tensor in one object (one part: a single verified read), and that object."""
    url = str(tmp_path / "root")
    storage.save({"w": _ref()}, url, step=1)
    objects = sorted((tmp_path / "root" / "step-1").glob("*.safetensors"))
    assert len(objects) == 1
    return url, objects[0]


def _rewrite_after_the_check(monkeypatch: pytest.MonkeyPatch, other: Path) -> list[int]:
    """After the first part is read and verified, and before its bytes are copied, overwrite the
    object in place through ``other`` (as the persister's next save into a slot file would)."""
    real = _reader._fetch_part
    done: list[int] = []

    def fetch_then_rewrite(*args: Any) -> list:
        out = real(*args)
        if not done:
            with open(other, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                f.write(b"\xff" * size)
            done.append(size)
        return out

    monkeypatch.setattr(_reader, "_fetch_part", fetch_then_rewrite)
    return done


def _load(url: str) -> torch.Tensor:
    target = {"w": torch.zeros(64, 32)}
    storage.load(target, url)
    return target["w"]


def _load_state_dict(url: str) -> torch.Tensor:
    return storage.load_state_dict(url)["w"]


def _lazy(url: str) -> torch.Tensor:
    with storage.LazyStateDict(url) as sd:
        return sd["w"]


def _convert(url: str) -> torch.Tensor:
    dst = url + "-converted"
    convert(url, dst, to="ftsdp", overwrite=True)
    return storage.load_state_dict(dst)["w"]  # checksums of the converted bytes: they verify


READERS: dict[str, Callable[[str], torch.Tensor]] = {
    "load": _load,
    "load_state_dict": _load_state_dict,
    "LazyStateDict": _lazy,
    "convert": _convert,
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_rewrite_through_another_link_after_the_check_does_not_reach_the_target(
    saved: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    url, obj = saved
    other = obj.parent.parent.parent / "slot-file"
    os.link(obj, other)
    done = _rewrite_after_the_check(monkeypatch, other)
    got = READERS[reader](url)
    assert done, "the object was rewritten between its check and its copy"
    assert torch.equal(got, _ref())


@pytest.fixture
def file_mappings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The inode of the file of every file mapping made from now on (anonymous ones left out)."""
    calls: list[int] = []

    class Counted(mmap.mmap):
        def __new__(cls, fileno: int, *args: Any, **kwargs: Any) -> Counted:
            if fileno != -1:
                calls.append(os.fstat(fileno).st_ino)
            return super().__new__(cls, fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", Counted)
    return calls


@pytest.mark.parametrize("reader", sorted(READERS))
def test_an_object_with_one_name_is_mapped_and_one_with_two_is_not(
    saved: tuple[str, Path], file_mappings: list[int], reader: str
) -> None:
    url, obj = saved
    inode = obj.stat().st_ino
    assert torch.equal(READERS[reader](url), _ref())
    assert inode in file_mappings, "one link: the object's pages are mapped"
    file_mappings.clear()
    os.link(obj, obj.parent.parent.parent / "backup")
    assert torch.equal(READERS[reader](url), _ref())
    assert inode not in file_mappings, "two links: the object is read privately"


def test_a_rewrite_before_the_read_fails_loudly(saved: tuple[str, Path]) -> None:
    url, obj = saved
    other = obj.parent.parent.parent / "slot-file"
    os.link(obj, other)
    with open(other, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    target = {"w": torch.zeros(64, 32)}
    with pytest.raises(storage.CorruptCheckpointError, match="checksum mismatch"):
        storage.load(target, url)
    assert not target["w"].any()
