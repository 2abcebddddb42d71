"""A step that retention or gc removes while ``verify``, ``diff`` or ``gc`` runs is that removal,
not corruption: the race is made deterministic by removing the step (as retention does: its
manifest first, then its objects) between the listing and the check."""

from __future__ import annotations

import io
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.catalog import _checks
from ftsdp.storage.conversion._sources import FtsdpSource
from ftsdp.storage.format import _steps
from ftsdp.storage.format._steps import remove_step
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._local import LocalStore
from ftsdp.tools.ckpt import main

SMALL = storage.SaveOptions(checksum_block_bytes=64, object_bytes=2000)
REMOVED = "removed while checking (retention or gc)"


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    for step in (1, 2, 3):
        state = {"w": torch.randn(40, 30), "b": torch.arange(9) * step, "step": step}
        storage.save(state, str(tmp_path / "ckpt"), step=step, options=SMALL)
    return tmp_path / "ckpt"


def _objects(root: pathlib.Path, step: int) -> list[pathlib.Path]:
    manifest = storage.catalog.read_manifest(str(root), step)
    return [root / f"step-{step}" / name for name in sorted(manifest.objects)]


def _before(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, act: Callable[..., None]):
    """Run ``act(*args)`` before each call of ``owner.name``."""
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        act(*args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("when", ["before its manifest is read", "before its objects are read"])
def test_verify_a_step_removed_meanwhile_is_no_problem(root, monkeypatch, when) -> None:
    store = Store(str(root), None)
    if when == "before its manifest is read":  # between the listing and the manifest's read
        _before(
            monkeypatch,
            _checks,
            "read_manifest_file",
            lambda s, rel: rel == "step-1/manifest.json" and remove_step(store, 1),
        )
    else:  # after the manifests were read, before step 1's objects are checked
        _before(
            monkeypatch,
            _checks,
            "_verify_step",
            lambda s, step, *_: step == 1 and remove_step(store, 1),
        )
    code, out, err = _cli("verify", str(root), "-q")
    assert (code, err) == (0, ""), out
    assert out.splitlines() == [f"step 1: {REMOVED}", out.splitlines()[-1]]
    assert out.splitlines()[-1].startswith("OK: ftsdp") and "step(s) 2, 3," in out
    assert not (root / "step-1").exists() and storage.list_steps(str(root)) == [2, 3]


@pytest.mark.parametrize("read", ["_check_header", "map_range"])
def test_verify_a_step_removed_while_its_objects_are_read(root, monkeypatch, read) -> None:
    """Removed after its directory was listed: its objects vanish under the header reads, or
    under the data reads once the headers were read (the review's bare ``[Errno 2]``, exit 2)."""
    store = Store(str(root), None)
    if read == "_check_header":
        _before(monkeypatch, _checks, read, lambda s, step, *_: step == 2 and remove_step(s, 2))
    else:
        _before(
            monkeypatch, LocalStore, read, lambda s, rel, *_: "step-2/" in rel and remove_step(s, 2)
        )
    code, out, err = _cli("verify", str(root), "-q")
    assert (code, err) == (0, ""), out
    assert out.splitlines()[:-1] == [f"step 2: {REMOVED}"] and "step(s) 1, 3," in out
    assert storage.list_steps(str(root)) == [1, 3] and store.exists("step-3/manifest.json")


def test_a_missing_object_of_a_step_still_there_is_a_problem(root, monkeypatch) -> None:
    """The manifest is still there: an object gone after the listing (before its header or its
    data is read), missing, short, or a directory is corruption, named, never a bare errno."""
    one, two, three = _objects(root, 1), _objects(root, 2), _objects(root, 3)
    assert len(three) >= 3

    def unlink(path: pathlib.Path) -> Callable[..., None]:
        return lambda *args: str(path) in map(str, args) and path.unlink(missing_ok=True)

    _before(monkeypatch, LocalStore, "map_range", lambda s, rel, *_: unlink(one[0])(s.full(rel)))
    _before(
        monkeypatch,
        _checks,
        "_check_header",
        lambda s, step, name, *_: unlink(two[0])(s.full(f"step-{step}/{name}")),
    )
    three[0].unlink()
    three[1].write_bytes(three[1].read_bytes()[:-1])
    three[2].unlink()
    three[2].mkdir()
    code, out, err = _cli("verify", str(root), "-q")
    problems = [line.removeprefix("PROBLEM: ") for line in out.splitlines()[:-1]]
    assert code == 1 and err == "" and out.splitlines()[-1].startswith("FAILED (5 problems)"), out
    assert problems == [
        f"step 1: object {one[0]} is missing",  # once, however many parts it has
        f"step 2: object {two[0]} is missing",
        f"step 3: object {three[0]} is missing",
        f"step 3: object {three[1]} has {three[1].stat().st_size} bytes, the manifest lists "
        f"{three[1].stat().st_size + 1}",
        f"step 3: object {three[2]} is a directory, not a file",
    ]
    assert not one[0].exists() and not two[0].exists()


def test_verify_of_one_step_removed_meanwhile_says_so(root, monkeypatch) -> None:
    store = Store(str(root), None)
    _before(monkeypatch, _checks, "_verify_step", lambda s, step, *_: remove_step(store, step))
    code, _, err = _cli("verify", str(root), "--step", "2", "-q")
    assert code == 2 and err.strip() == f"ftsdp-ckpt: error: step 2: {REMOVED}", err


def test_diff_of_a_step_removed_meanwhile_says_so(root, monkeypatch) -> None:
    store = Store(str(root), None)
    _before(
        monkeypatch,
        FtsdpSource,
        "read_into",
        lambda source, _: source.step == 1 and remove_step(store, 1),
    )
    code, _, err = _cli("diff", str(root), "1", "3", "-q")
    assert code == 2 and err.strip() == f"ftsdp-ckpt: error: step 1: {REMOVED}", err


def test_diff_of_a_step_whose_object_vanished_says_it_is_incomplete(root, monkeypatch) -> None:
    objects = _objects(root, 1)
    _before(
        monkeypatch,
        FtsdpSource,
        "read_into",
        lambda *_: [p.unlink(missing_ok=True) for p in objects],
    )
    code, _, err = _cli("diff", str(root), "1", "3", "-q")
    assert code == 2 and "Errno" not in err, err
    assert err.startswith(f"ftsdp-ckpt: error: step 1: {objects[0]}") and "is missing" in err


def test_gc_beside_another_gc_says_the_step_was_removed_by_it(root, monkeypatch) -> None:
    """Two gc runs at once: the other removed step 1 (its manifest first) while this one read
    it. Not 'left alone ... (manifest.json vanished)': removed by someone else."""
    store = Store(str(root), None)
    _before(
        monkeypatch,
        _steps,
        "read_manifest_file",
        lambda s, rel, *_: rel == "step-1/manifest.json" and remove_step(store, 1),
    )
    code, out, _ = _cli("gc", str(root), "--keep-last", "1")
    assert code == 0 and "left alone" not in out, out
    assert (
        f"removed by someone else meanwhile (another gc or a job's retention): {root}/step-1" in out
    )
    assert "removed steps [2]" in out and storage.list_steps(str(root)) == [3]
