"""The golden checkpoint (format version 1, tests/golden/storage_v1) reads to the exact tensors."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import torch
from safetensors.torch import load_file

from ftsdp import storage
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

    # Each data object is a plain safetensors file of 1-D pieces.
    obj = manifest.tensors["model.w"].pieces[0]
    pieces = load_file(str(root / f"step-{STEP}" / obj.object))
    assert torch.equal(pieces[obj.key], expected["model"]["w"].reshape(-1)[: obj.length])


def test_writer_still_produces_golden_bytes(tmp_path: pathlib.Path) -> None:
    """The same state saved today gives byte-identical objects (names aside)."""
    storage.save(golden_state(), str(tmp_path), step=STEP, options=OPTIONS)
    new = json.loads((tmp_path / f"step-{STEP}" / "manifest.json").read_text())
    old = json.loads((GOLDEN / f"step-{STEP}" / "manifest.json").read_text())
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
