"""Bad input: each a clear error, and nothing partially loaded."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ftsdp import storage

OPTS = storage.SaveOptions(object_bytes=64, checksum_block_bytes=32)  # 'w' spans 3 objects


def _ref() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, generator=g), "b": torch.randn(2, 3, generator=g), "step": 3}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(40), "b": torch.zeros(2, 3), "step": 0}


def _untouched(target: dict[str, Any]) -> None:
    assert not target["w"].any() and not target["b"].any() and target["step"] == 0


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    storage.save(_ref(), str(tmp_path), step=1, options=OPTS)
    return tmp_path


def _edit(root: Path, fn: Callable[[dict], None]) -> None:
    path = root / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def _w(doc: dict) -> list[dict]:
    return doc["tensors"]["w"]["pieces"]


def _shift(p: dict, by: int) -> None:
    p["byte_range"] = [p["byte_range"][0] + by, p["byte_range"][1] + by]


def _rename(doc: dict, new: str) -> None:
    old = _w(doc)[0]["object"]
    doc["objects"][new] = doc["objects"].pop(old)
    for t in doc["tensors"].values():
        for p in t["pieces"]:
            if p["object"] == old:
                p["object"] = new


CASES = {
    "newer version": (lambda d: d.update(version=2), storage.NewerFormatError, "newer"),
    "other format": (lambda d: d.update(format="dcp"), storage.CorruptCheckpointError, "format"),
    "dotdot": (lambda d: _rename(d, "..x"), storage.CorruptCheckpointError, "escapes"),
    "parent": (lambda d: _rename(d, "../step-0/x"), storage.CorruptCheckpointError, "escapes"),
    "absolute": (lambda d: _rename(d, "/etc/passwd"), storage.CorruptCheckpointError, "escapes"),
    "bucket": (lambda d: _rename(d, "s3://other/x"), storage.CorruptCheckpointError, "escapes"),
    "negative offset": (
        lambda d: _w(d)[0].update(offset=-1),
        storage.CorruptCheckpointError,
        "offset must be a non-negative",
    ),
    "overlap": (
        lambda d: _w(d)[1].update(offset=_w(d)[1]["offset"] - 1),
        storage.CorruptCheckpointError,
        "overlap",
    ),
    "gap": (
        lambda d: _w(d)[1].update(offset=_w(d)[1]["offset"] + 1),
        storage.CorruptCheckpointError,
        "not covered",
    ),
    "past object end": (
        lambda d: _shift(_w(d)[-1], 8),
        storage.CorruptCheckpointError,
        "past the end",
    ),
    "length vs bytes": (
        lambda d: _w(d)[0].update(length=_w(d)[0]["length"] + 1),
        storage.CorruptCheckpointError,
        "but length",
    ),
    "length vs shape": (
        lambda d: d["tensors"]["w"].update(shape=[41]),
        storage.CorruptCheckpointError,
        r"\[40, 41\) are not covered",
    ),
    "crc count": (
        lambda d: _w(d)[0].update(crc32=[]),
        storage.CorruptCheckpointError,
        "one checksum per",
    ),
    "dtype": (
        lambda d: d["tensors"]["w"].update(dtype="float128"),
        storage.CorruptCheckpointError,
        "unknown dtype",
    ),
    "size": (
        lambda d: d["objects"].update({_w(d)[0]["object"]: {"size": -1}}),
        storage.CorruptCheckpointError,
        "bad size",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_manifest(ckpt: Path, case: str) -> None:
    edit, error, match = CASES[case]
    _edit(ckpt, edit)
    target = _blank()
    with pytest.raises(error, match=match) as err:
        storage.load(target, str(ckpt))
    assert "manifest.json" in str(err.value) or case == "newer version"
    _untouched(target)


def test_manifest_not_json(ckpt: Path) -> None:
    (ckpt / "step-1" / "manifest.json").write_text("{not json")
    with pytest.raises(storage.CorruptCheckpointError, match="not valid JSON"):
        storage.load(_blank(), str(ckpt))


def test_missing_root_and_no_commit(tmp_path: Path) -> None:
    with pytest.raises(storage.CheckpointNotFoundError, match="does not exist"):
        storage.load(_blank(), str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):  # the built-in it maps to
        storage.load_state_dict(str(tmp_path / "nope"))
    assert storage.list_steps(str(tmp_path / "nope")) == []
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-4" / "rank00000-000-abcdabcd.safetensors").write_bytes(b"torn")
    with pytest.raises(storage.CheckpointNotFoundError, match=r"no committed step.*\[4\]"):
        storage.load(_blank(), str(tmp_path))


def test_key_shape_and_dtype_mismatches(ckpt: Path) -> None:
    url, ref = str(ckpt), _ref()
    cases = {
        "missing": ({**_blank(), "extra": torch.zeros(2)}, r"missing=\['extra'\]"),
        "unexpected": ({"w": torch.zeros(40), "step": 0}, r"unexpected=\['b'\]"),
        "shape": (
            {**_blank(), "b": torch.zeros(3, 2)},
            r"b \(saved shape \[2, 3\], target \[3, 2\]",
        ),
        "dtype": ({**_blank(), "w": torch.zeros(40, dtype=torch.float64)}, "pass cast=True"),
        "kind": ({**_blank(), "step": torch.zeros(1)}, r"mismatched=\['step'\]"),
    }
    for name, (target, match) in cases.items():
        before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in target.items()}
        with pytest.raises(storage.StateMismatchError, match=match):
            storage.load(target, url)
        for k, v in before.items():
            assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v, (
                name
            )
    # strict=False loads what matches and reports the rest.
    target = {**_blank(), "b": torch.zeros(3, 2), "extra": torch.zeros(2)}
    res = storage.load(target, url, strict=False)
    assert res.missing == ["extra"] and res.unexpected == [] and len(res.mismatched) == 1
    assert torch.equal(target["w"], ref["w"]) and not target["b"].any() and target["step"] == 3
    # cast=True converts, explicitly.
    target = {**_blank(), "w": torch.zeros(40, dtype=torch.float64)}
    storage.load(target, url, cast=True)
    assert torch.equal(target["w"], ref["w"].double())


def test_bad_state_on_save(tmp_path: Path) -> None:
    url = str(tmp_path)
    with pytest.raises(TypeError, match=r"opt\.fn: value of type builtin_function_or_method"):
        storage.save({"opt": {"fn": print}}, url, step=0)
    with pytest.raises(ValueError, match="step=-1"):
        storage.save({"a": torch.zeros(1)}, url, step=-1)
    with pytest.raises(ValueError, match=r"dtype torch\.complex128 cannot be checkpointed"):
        storage.save({"a": torch.zeros(1, dtype=torch.complex128)}, url, step=0)
    with pytest.raises(ValueError, match=r"same name 'a\.b'"):
        storage.save({"a.b": 1, "a": {"b": 2}}, url, step=0)
    storage.save({"a": torch.zeros(1)}, url, step=0)
    with pytest.raises(FileExistsError, match="step 0 is already committed"):
        storage.save({"a": torch.ones(1)}, url, step=0)
    assert storage.list_steps(url) == [0]
    for bad in ((-1, torch.zeros(2)), (9, torch.zeros(2)), (0, torch.zeros(2, 2))):
        with pytest.raises(ValueError, match="FlatShard"):
            storage.FlatShard((10,), *bad)
    with pytest.raises(ValueError, match="object_bytes=0 must be > 0"):
        storage.SaveOptions(object_bytes=0)
