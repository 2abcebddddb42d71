"""The golden checkpoint (format version 1, tests/golden/storage_v1) reads to the exact tensors."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import torch
from safetensors.torch import load_file

from ftsdp import storage
from ftsdp.storage._manifest import SELF_CHECKSUM, canonical_json
from ftsdp.storage._safetensors import crc32
from tests.make_storage_golden import GOLDEN, OPTIONS, STEP, golden_state


def _blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    return None


def test_golden_reads_exactly(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN, root)  # never touch the checked-in copy
    expected = golden_state()
    assert storage.list_steps(str(root)) == [STEP]
    manifest = storage.read_manifest(str(root))
    assert manifest.version == 1 and manifest.world_size == 1
    assert len(manifest.tensors["model.big"].pieces) > 1  # spans several objects

    target = _blank(expected)
    result = storage.load(target, str(root))
    assert result.step == STEP and target["trainer"] == expected["trainer"]
    for group in ("model", "optim"):
        for name, ref in expected[group].items():
            got = target[group][name]
            assert got.dtype == ref.dtype and torch.equal(got, ref), name

    full = storage.load_state_dict(str(root))
    assert sorted(full) == ["model.b", "model.big", "model.w", "optim.mask", "optim.step"]
    assert torch.equal(full["model.w"], expected["model"]["w"])
    assert full["model.w"].tolist()[2] == [2.0, 2.25, 2.5, 2.75]

    assert storage.verify(str(root)).ok  # no manifest checksum to check: verify says OK

    # Each data object is a plain safetensors file of 1-D pieces.
    obj = manifest.tensors["model.w"].pieces[0]
    pieces = load_file(str(root / f"step-{STEP}" / obj.object))
    assert torch.equal(pieces[obj.key], expected["model"]["w"].reshape(-1)[: obj.length])


def test_writer_still_produces_golden_bytes(tmp_path: pathlib.Path) -> None:
    """The same state saved today gives byte-identical objects (names aside) and the golden
    manifest, but for the version (2) and the manifest checksum that version 2 added."""
    storage.save(golden_state(), str(tmp_path), step=STEP, options=OPTIONS)
    new = json.loads((tmp_path / f"step-{STEP}" / "manifest.json").read_text())
    old = json.loads((GOLDEN / f"step-{STEP}" / "manifest.json").read_text())
    # Version 2 adds the manifest checksum (required); the golden is version 1, without it.
    assert new.pop(SELF_CHECKSUM) == {"algorithm": "crc32", "value": crc32(canonical_json(new))}
    assert SELF_CHECKSUM not in old and (old.pop("version"), new.pop("version")) == (1, 2)
    for doc in (new, old):
        attempt = doc.pop("attempt")
        doc["objects"] = {k.replace(attempt, "*"): v for k, v in doc["objects"].items()}
        for t in doc["tensors"].values():
            for p in t["pieces"]:
                p["object"] = p["object"].replace(attempt, "*")
    assert new == old
    new_objs = sorted((tmp_path / f"step-{STEP}").glob("*.safetensors"))
    old_objs = sorted((GOLDEN / f"step-{STEP}").glob("*.safetensors"))
    assert [p.read_bytes() for p in new_objs] == [p.read_bytes() for p in old_objs]


def test_manifest_checksum_encoding_is_pinned() -> None:
    """The canonical encoding the manifest checksum covers (docs/format.md) never changes by
    accident: sorted keys, no whitespace, ASCII escapes, Python's float repr, the field left out."""
    doc = {
        "version": 2,
        "values": {"b": 0.1, "a": [1, "é\n", None, True, -0.0, 1e-07]},
        SELF_CHECKSUM: {"algorithm": "crc32", "value": 0},
    }
    text = b'{"values":{"a":[1,"\\u00e9\\n",null,true,-0.0,1e-07],"b":0.1},"version":2}'
    assert canonical_json(doc) == text
    assert crc32(text) == 1474384153
