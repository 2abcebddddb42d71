"""Safety of deletion (docs/format.md, "Threat model"): gc and retention delete only what is
provably ours: never a folder that merely looks like a root, never a step whose manifest is
unreadable, nothing behind a link; ``--keep-last 0`` is refused.

Local directory and S3 (moto) where the store matters.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import fsspec
import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main as cli
from tests.s3_fixture import s3_bucket_url, s3_endpoint  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)
SMALL = storage.SaveOptions(checksum_block_bytes=64, object_bytes=3000)


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> tuple[str, dict | None]:
    """``(url, storage_options)`` of an empty root on a local disk and on S3 (moto)."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3_bucket_url"), dict(request.getfixturevalue("s3_endpoint"))


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
    assert storage.apply_retention(url, keep_last=1, storage_options=opts) == []
    assert _tree(url, opts) == before


def test_an_unreadable_manifest_never_counts_toward_keep_last(backend) -> None:
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
    report = storage.collect_garbage(url, keep_last=1, storage_options=opts)
    assert report.removed_steps == [] and report.kept_steps == [1] and report.left_alone
    # Retention after a save: the unreadable step neither counts nor goes.
    with pytest.warns(UserWarning, match="step-2: left alone"):
        storage.save(_state(3), url, step=3, keep_last=1, storage_options=opts, options=SMALL)
    tree = _tree(url, opts)
    assert not any(p.startswith("step-1/") for p in tree)
    assert {p: b for p, b in tree.items() if p.startswith("step-2/")} == {
        p: b for p, b in before.items() if p.startswith("step-2/")
    }
    _same(_load(url, opts, 3), _state(3))


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
    report = storage.collect_garbage(url, keep_last=2, storage_options=opts)
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
    assert storage.collect_garbage(url, dry_run=True).kept_steps == [3]
    assert (tmp_path / "ckpt/step-1").is_dir()  # the link in it stays, so the directory does
    assert [p.name for p in (tmp_path / "ckpt/step-1").iterdir()] == [
        "rank00000-000-dddddddd.safetensors"
    ]


def test_keep_last_0_is_refused(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "ckpt")
    for step in (1, 2):
        storage.save(_state(step), url, step=step, options=SMALL)
    code, out, err = _gc(url, "--keep-last", "0")
    assert code == 2 and out == "" and "--keep-last" in err and ">= 1" in err
    with pytest.raises(ValueError, match="keep_last=0"):
        storage.collect_garbage(url, keep_last=0)
    with pytest.raises(ValueError, match="keep_last=0"):
        storage.apply_retention(url, keep_last=0)
    assert storage.list_steps(url) == [1, 2]
