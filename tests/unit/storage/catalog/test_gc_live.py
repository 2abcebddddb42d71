"""``gc`` beside a job that is saving, and over damaged steps (docs/format.md, "Retention and
garbage collection"):

- a save below the newest committed step (a job that resumed from an older step because the
  newest could not load) is not a torn attempt to ``gc`` while it is being written, nor is a
  save replacing a damaged step's objects: gc leaves uncommitted files written within its grace
  period, the save commits, the step loads;
- ``--keep-last`` counts only steps that can load: a newest step whose object is short is kept
  (and named) but not counted, so the loadable steps before it stay;
- a removal that fails does not stop the others, and says so;
- what is not a root (a file, a step directory, an empty URL) is refused.
"""

from __future__ import annotations

import io
import os
import pathlib
import threading
import time
from dataclasses import replace

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.catalog import collect_garbage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.saving import _commit
from ftsdp.tools.ckpt import main as cli

pytestmark = pytest.mark.timeout(120)


def _state(step: int) -> dict:
    return {"w": torch.full((64,), float(step)), "b": torch.arange(8.0) + step}


def _loads(url: str, step: int) -> bool:
    got = storage.load_state_dict(url, step)
    return all(torch.equal(got[k], v) for k, v in _state(step).items())


def _short(url: str, step: int) -> None:
    """Cut 10 bytes off an object of ``step`` (its manifest stays valid)."""
    folder = pathlib.Path(url) / f"step-{step}"
    obj = next(p for p in folder.iterdir() if p.suffix == ".safetensors")
    obj.write_bytes(obj.read_bytes()[:-10])


class _HeldCommit:
    """Saves whose commit waits until released: their objects are written, their manifest not."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        real = _commit.commit

        def held(*args, **kwargs):
            self.reached.set()
            assert self.release.wait(60)
            return real(*args, **kwargs)

        monkeypatch.setattr(_commit, "commit", held)


@pytest.mark.parametrize("replacing", [False, True], ids=["older-step", "same-step"])
def test_gc_leaves_a_save_in_progress_below_the_newest_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, replacing: bool
) -> None:
    url = str(tmp_path / "ckpt")
    for step in (2, 4, 900):
        storage.save(_state(step), url, step)
    _short(url, 900)  # the newest step cannot load: the job resumed from step 4
    step = 900 if replacing else 6
    held = _HeldCommit(monkeypatch)
    options = storage.SaveOptions(discard_newer=True)
    handle = storage.save(_state(step), url, step, async_save=True, options=options)
    assert held.reached.wait(60)  # its objects are written, its manifest is not
    report = collect_garbage(url, keep_last=1)
    held.release.set()
    handle.wait(60)  # committed: gc removed none of its objects
    assert storage.list_steps(url)[-1] == step and _loads(url, step)
    assert 4 in report.kept_steps and 900 in report.kept_steps  # 900: kept, not counted
    if not replacing:
        assert report.in_progress == [6]
    else:
        assert any("less than 3600 s ago" in n for n in report.left_alone), report.left_alone
    assert report.failed == []


def test_gc_with_no_grace_removes_a_fresh_torn_attempt(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "ckpt")
    for step in (2, 4):
        storage.save(_state(step), url, step)
    torn = pathlib.Path(url) / "step-3"
    torn.mkdir()
    (torn / "rank00000-000-aaaaaaaa.safetensors").write_bytes(b"torn")
    assert collect_garbage(url).in_progress == [3] and torn.exists()
    old = time.time() - 7200  # written two hours ago: no save is that slow between writes
    os.utime(torn / "rank00000-000-aaaaaaaa.safetensors", (old, old))
    assert collect_garbage(url).removed_steps == [3] and not torn.exists()
    torn.mkdir()
    (torn / "rank00000-000-bbbbbbbb.safetensors").write_bytes(b"torn")
    assert collect_garbage(url, grace_s=0).removed_steps == [3] and not torn.exists()


def test_keep_last_counts_only_steps_that_load(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "ckpt")
    for step in (2, 4, 6, 8):
        storage.save(_state(step), url, step)
    _short(url, 8)
    _short(url, 4)  # past retention either way: removed
    out = io.StringIO()
    assert cli(["gc", url, "--keep-last", "1"], out, out) == 0
    assert storage.list_steps(url) == [6, 8], out.getvalue()
    assert _loads(url, 6)
    assert "step-8: kept, but not counted (its object" in out.getvalue()


def test_a_failed_removal_does_not_stop_the_others(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "ckpt")
    for step in (2, 4, 6):
        storage.save(_state(step), url, step)
    real = Store.remove

    def refuse_step_2(self, rel):
        if rel.startswith("step-2/"):
            raise PermissionError(1, "Operation not permitted", self.full(rel))
        return real(self, rel)

    monkeypatch.setattr(Store, "remove", refuse_step_2)
    out = io.StringIO()
    assert cli(["gc", url, "--keep-last", "1"], out, out) == 1
    text = out.getvalue()
    assert "FAILED: " in text and "step-2" in text and "Operation not permitted" in text
    assert "removed steps [4]" in text, text
    assert storage.list_steps(url) == [2, 6]


def test_what_is_not_a_root_is_refused(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "ckpt")
    storage.save(_state(2), url, 2)
    (tmp_path / "a-file").write_bytes(b"x")
    for bad, said in (
        (str(tmp_path / "a-file"), "is a file, not a checkpoint root"),
        (f"{url}/step-2", "is a step directory; its checkpoint root is the folder above"),
        ("", "the checkpoint URL is empty"),
    ):
        out = io.StringIO()
        assert cli(["gc", bad], out, out) == 2, bad
        lines = out.getvalue().strip().splitlines()
        assert len(lines) == 1 and said in lines[0], lines
    assert storage.list_steps(url) == [2] and _loads(url, 2)


def test_retention_during_saves_keeps_its_figures(tmp_path: pathlib.Path) -> None:
    """A job's own retention (at each commit) has no grace: it runs between its own saves."""
    url = str(tmp_path / "ckpt")
    options = replace(storage.SaveOptions(), keep_last=2)
    for step in (1, 2, 3):
        storage.save(_state(step), url, step, options=options)
    torn = pathlib.Path(url) / "step-0"
    torn.mkdir()
    (torn / "rank00000-000-aaaaaaaa.safetensors").write_bytes(b"torn")
    storage.save(_state(4), url, 4, options=options)
    assert storage.list_steps(url) == [3, 4] and not torn.exists()


def test_a_grace_that_is_not_a_number_of_seconds_is_refused(tmp_path: pathlib.Path) -> None:
    """nan or a negative grace made every comparison false: the grace was off, silently."""
    url = str(tmp_path / "ckpt")
    storage.save(_state(2), url, 2)
    for bad in ("nan", "-1", "inf"):
        out = io.StringIO()
        assert cli(["gc", url, "--grace-s", bad], out, out) == 2, bad
        assert "must be a number of seconds >= 0" in out.getvalue()
        with pytest.raises(ValueError, match="grace_s"):
            collect_garbage(url, grace_s=float(bad))
    assert storage.list_steps(url) == [2]
