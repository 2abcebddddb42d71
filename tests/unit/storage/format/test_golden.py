"""The golden checkpoints of format versions 1 and 2 (tests/golden/storage_v1, storage_v2: CRC-32
checksums) read to the exact tensors, and today's writer (version 3, CRC-32C) writes the same
objects and the same manifest but for the version and the checksums."""

from __future__ import annotations

import json
import pathlib
import shutil
import zlib
from typing import Any

import crc32c
import pytest
import torch
from safetensors.torch import load_file

from ftsdp import storage
from ftsdp.storage.format._manifest import SELF_CHECKSUM, canonical_json, seal
from tests.make_storage_golden import GOLDEN, OPTIONS, STEP, golden_state

# Written by the version 2 writer (the same state and options as GOLDEN); never regenerated.
GOLDEN_V2 = GOLDEN.parent / "storage_v2"


def _blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    return None


@pytest.mark.parametrize("version", [1, 2])
def test_golden_reads_exactly(tmp_path: pathlib.Path, version: int) -> None:
    root = tmp_path / "golden"
    shutil.copytree(GOLDEN if version == 1 else GOLDEN_V2, root)  # never touch the checked-in copy
    expected = golden_state()
    assert storage.list_steps(str(root)) == [STEP]
    manifest = storage.catalog.read_manifest(str(root))
    assert manifest.version == version and manifest.world_size == 1
    assert manifest.checksum_algorithm == "crc32"
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

    assert storage.catalog.verify(str(root)).ok

    # A flipped byte in a data object is found with the old algorithm too.
    obj = manifest.tensors["model.big"].pieces[0]
    path = root / f"step-{STEP}" / obj.object
    original = path.read_bytes()
    data = bytearray(original)
    data[obj.byte_start] ^= 0x40
    path.write_bytes(bytes(data))
    report = storage.catalog.verify(str(root))
    assert not report.ok and any("checksum mismatch" in p for p in report.problems), report
    with pytest.raises(storage.CorruptCheckpointError, match="checksum mismatch"):
        storage.load_state_dict(str(root))
    path.write_bytes(original)

    # Each data object is a plain safetensors file of 1-D pieces.
    obj = manifest.tensors["model.w"].pieces[0]
    pieces = load_file(str(root / f"step-{STEP}" / obj.object))
    assert torch.equal(pieces[obj.key], expected["model"]["w"].reshape(-1)[: obj.length])


def _block_checksums(data: bytes, start: int, end: int, block: int, f: Any) -> list[int]:
    return [f(data[a : min(a + block, end)]) for a in range(start, end, block)]


@pytest.mark.parametrize("version", [1, 2])
def test_writer_still_produces_golden_bytes(tmp_path: pathlib.Path, version: int) -> None:
    """The same state saved today gives byte-identical objects (names aside) and the golden
    manifest, but for the version (3), its CRC-32C checksums (computed here with the crc32c
    package over the same bytes the golden's CRC-32s cover) and the manifest checksum (required
    from version 2 on; CRC-32C from 3)."""
    golden = GOLDEN if version == 1 else GOLDEN_V2
    storage.save(golden_state(), str(tmp_path), step=STEP, options=OPTIONS)
    new = json.loads((tmp_path / f"step-{STEP}" / "manifest.json").read_text())
    old = json.loads((golden / f"step-{STEP}" / "manifest.json").read_text())
    assert new.pop(SELF_CHECKSUM) == {
        "algorithm": "crc32c",
        "value": crc32c.crc32c(canonical_json(new)),
    }
    if version == 1:
        assert SELF_CHECKSUM not in old
    else:
        assert old.pop(SELF_CHECKSUM) == {
            "algorithm": "crc32",
            "value": zlib.crc32(canonical_json(old)),
        }
    assert (old.pop("version"), new.pop("version")) == (version, 3)
    assert (old["checksum"].pop("algorithm"), new["checksum"].pop("algorithm")) == (
        "crc32",
        "crc32c",
    )
    block = new["checksum"]["block_bytes"]
    for doc, key, f, root in (
        (new, "crc32c", crc32c.crc32c, tmp_path),
        (old, "crc32", zlib.crc32, golden),
    ):
        for t in doc["tensors"].values():
            for p in t["pieces"]:
                data = (root / f"step-{STEP}" / p["object"]).read_bytes()
                assert p.pop(key) == _block_checksums(data, *p["byte_range"], block, f)
    for doc in (new, old):
        attempt = doc.pop("attempt")
        doc["objects"] = {k.replace(attempt, "*"): v for k, v in doc["objects"].items()}
        for t in doc["tensors"].values():
            for p in t["pieces"]:
                p["object"] = p["object"].replace(attempt, "*")
    assert new == old
    new_objs = sorted((tmp_path / f"step-{STEP}").glob("*.safetensors"))
    old_objs = sorted((golden / f"step-{STEP}").glob("*.safetensors"))
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
    assert zlib.crc32(text) == 1474384153  # versions 1 and 2
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # CRC-32C's check value (version 3)


def test_a_written_manifest_holds_the_canonical_pieces_and_the_checksum() -> None:
    """What a save writes (``sealed_json``, one encoding of each value) decodes to the document
    ``seal`` makes; its checksum is the CRC-32C of ``canonical_json``; the top-level keys keep
    the document's order (``format`` first: detection reads a manifest's first 64 bytes), and
    the user's values theirs."""
    from ftsdp.storage.format._manifest import sealed_json

    doc = {
        "format": "ftsdp.storage",
        "version": 3,
        "attempt": "ab12",
        "values": {"b": 0.1, "a": ["\u00e9", {"z": 1, "y": [None, -0.0]}]},
    }
    data = sealed_json(dict(doc))
    assert json.loads(data) == seal(dict(doc))
    assert data.startswith(b'{"format":"ftsdp.storage","version":3,"attempt":"ab12",')
    assert list(json.loads(data)) == [*doc, SELF_CHECKSUM]
    values = json.loads(data)["values"]  # the user's dicts keep their order in the file
    assert list(values) == ["b", "a"] and list(values["a"][1]) == ["z", "y"]
    value = json.loads(data)[SELF_CHECKSUM]["value"]
    assert value == crc32c.crc32c(canonical_json(doc))


def test_a_manifest_encodes_as_its_document_encoded_anew() -> None:
    """What a save writes is byte for byte the document encoded anew, for the golden v4 table
    (rule and listed tensors), and decodes back to the same manifest; a changed entry (a name
    needing escapes, another rule, another shape) or a table without one is encoded from its
    own entries."""
    import dataclasses

    from ftsdp.storage.format._manifest import Manifest, sealed_json
    from ftsdp.storage.format._regular import Rule
    from tests.make_storage_golden_v4 import GOLDEN_V4
    from tests.make_storage_golden_v4 import STEP as STEP4

    data = (GOLDEN_V4 / f"step-{STEP4}" / "manifest.json").read_bytes()
    manifest = Manifest.from_json(data, where="golden v4")
    assert {t.rule is None for t in manifest.tensors.values()} == {True, False}
    first = manifest.to_json()
    anew = {k: v for k, v in json.loads(first).items() if k != SELF_CHECKSUM}
    assert sealed_json(anew) == first  # every value encoded by json.dumps
    assert manifest.to_json() == first
    assert Manifest.from_json(first, where="again") == manifest
    name, entry = next((n, t) for n, t in manifest.tensors.items() if t.rule is not None)
    ruled = dataclasses.replace(entry, rule=Rule("writer", writer=2))
    wider = dataclasses.replace(entry, shape=(*entry.shape, 1))
    for tensors in (
        {**manifest.tensors, 'é "q"': entry},
        {**manifest.tensors, name: ruled},
        {**manifest.tensors, name: wider},
        {n: t for n, t in manifest.tensors.items() if n != name},
    ):
        changed = dataclasses.replace(manifest, tensors=tensors)
        table = json.loads(changed.to_json())["tensors"]
        assert table == {n: changed._tensor_json(t) for n, t in tensors.items()}


def test_golden_v4_reads_exactly(tmp_path: pathlib.Path) -> None:
    """Version 4 (tests/golden/storage_v4: 3 ranks, rule tensors): a reader re-derives each
    rank's pieces from the rules with today's code, so this pins that code; the tensors come
    back exactly, the objects verify, and a flipped byte in a derived piece is caught."""
    from tests.make_storage_golden_v4 import GOLDEN_V4, reference
    from tests.make_storage_golden_v4 import STEP as STEP4

    root = tmp_path / "golden"
    shutil.copytree(GOLDEN_V4, root)
    manifest = storage.catalog.read_manifest(str(root))
    assert manifest.version == 4 and manifest.world_size == 3
    rules = {n: t.rule.kind if t.rule else None for n, t in manifest.tensors.items()}
    assert rules == {
        "model.w": "even",
        "model.b": "even",
        "rows": "even",
        "small": "writer",
        "big": "even",
        "uneven": None,
    }
    full = storage.load_state_dict(str(root))
    ref = reference()
    for name, key in (("model.w", "w"), ("model.b", "b"), ("rows", "rows"), ("small", "small")):
        assert full[name].dtype == ref[key].dtype and torch.equal(full[name], ref[key]), name
    assert torch.equal(full["big"], ref["big"]) and torch.equal(full["uneven"], ref["uneven"])
    target = {"model": {"w": torch.zeros(5, 6), "b": torch.zeros(7, dtype=torch.float64)}}
    storage.load(target, str(root), strict=False)
    assert torch.equal(target["model"]["w"], ref["w"]) and torch.equal(
        target["model"]["b"], ref["b"]
    )
    assert storage.catalog.verify(str(root)).ok

    piece = manifest.tensors["model.w"].pieces_in(20, 21)[0]  # derived from rank 1's layout
    _flipped_byte_is_caught(root, STEP4, piece)


def _flipped_byte_is_caught(root: pathlib.Path, step: int, piece: Any) -> None:
    """Flip the last byte of ``piece``: a whole load must fail on its checksum."""
    path = root / f"step-{step}" / piece.object
    data = bytearray(path.read_bytes())
    data[piece.byte_end - 1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(storage.CorruptCheckpointError, match="checksum mismatch"):
        storage.load_state_dict(str(root))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("object_bytes", [1, 64])
def test_v4_a_huge_rule_tensor_in_tiny_objects_is_refused_at_once(
    tmp_path: pathlib.Path, object_bytes: int
) -> None:
    """A resealed version 4 manifest whose rule tensor would pack into billions of objects for a
    rank that counts 3: the reader stops deriving at the count (it once packed on, for ever),
    and ``verify`` reports it as a problem of the step (it once raised)."""
    from ftsdp.storage.format._manifest import seal
    from tests.make_storage_golden_v4 import GOLDEN_V4
    from tests.make_storage_golden_v4 import STEP as STEP4

    root = tmp_path / "golden"
    shutil.copytree(GOLDEN_V4, root)
    path = root / f"step-{STEP4}" / "manifest.json"
    doc = json.loads(path.read_bytes())
    del doc["manifest_checksum"]
    n = 3 * 10**11
    doc["tensors"]["big"] = {"shape": [n], "dtype": "float32", "even": [0, n // 3]}
    doc["regular"]["object_bytes"] = object_bytes
    path.write_bytes(json.dumps(seal(doc)).encode())
    manifest = storage.catalog.read_manifest(str(root))
    with pytest.raises(storage.CorruptCheckpointError, match="more objects than the manifest's 3"):
        manifest.tensors["big"].pieces_in(0, 1)  # what a load of any part of it derives
    report = storage.catalog.verify(str(root))  # a problem of the step, not an exception
    assert not report.ok and "more objects than the manifest's 3" in report.problems[0], report


def test_golden_v5_reads_exactly(tmp_path: pathlib.Path) -> None:
    """Version 5 (tests/golden/storage_v5: 4 ranks on a 2 x 2 mesh, DTensor shards that are boxes
    of 2 and 3 dims, one under a layout rule): the tensors come back exactly, whole and as any
    box or flat range, the objects verify, and a flipped byte is caught."""
    from ftsdp.storage.format._grid import Box
    from ftsdp.storage.format._ranges import Range
    from ftsdp.storage.io._fs import Store
    from ftsdp.storage.loading._read_plan import make_want, plan_reads
    from ftsdp.storage.loading._reader import execute
    from tests.make_storage_golden_v5 import GOLDEN_V5, reference
    from tests.make_storage_golden_v5 import STEP as STEP5

    root = tmp_path / "golden"
    shutil.copytree(GOLDEN_V5, root)
    manifest = storage.catalog.read_manifest(str(root))
    assert manifest.version == 5 and manifest.world_size == 4
    grids = {n: t.grid for n, t in manifest.tensors.items()}
    assert grids == {
        "model.down": ((0, 3, 5), (0, 4, 7)),
        "model.up": None,  # row slabs: the row-major order
        "model.cols": ((0, 4), (0, 3, 6)),
        "model.cube": ((0, 2), (0, 2, 4), (0, 3, 6)),
        "model.bias": None,
        "model.even": ((0, 2, 4), (0, 3, 6)),
    }
    assert manifest.tensors["model.even"].rule is not None
    ref = {f"model.{k}": v for k, v in reference().items()}
    full = storage.load_state_dict(str(root))
    lazy = storage.LazyStateDict(str(root))
    for name, t in ref.items():
        assert full[name].dtype == t.dtype and torch.equal(full[name], t), name
        assert torch.equal(lazy[name], t), name
    assert storage.catalog.verify(str(root)).ok

    # Any box and any flat range of a grid tensor, read alone.
    store = Store(str(root), None)
    gen = torch.Generator().manual_seed(0)
    for name in ("model.down", "model.cube", "model.cols", "model.even"):
        entry, t = manifest.tensors[name], ref[name]
        for _ in range(20):
            lo = [int(torch.randint(0, n, (1,), generator=gen)) for n in t.shape]
            ln = [
                int(torch.randint(1, n - o + 1, (1,), generator=gen))
                for n, o in zip(t.shape, lo, strict=True)
            ]
            box = Box(tuple(lo), tuple(ln))
            a = int(torch.randint(0, t.numel(), (1,), generator=gen))
            b = int(torch.randint(a + 1, t.numel() + 1, (1,), generator=gen))
            wants = [
                make_want(name, entry, Range(0, 0), box),
                make_want(name, entry, Range(a, b - a)),
            ]
            execute(store, manifest, plan_reads(wants, manifest.checksum_block_bytes))
            sub = t[tuple(slice(o, o + n) for o, n in zip(lo, ln, strict=True))]
            assert torch.equal(wants[0].staging.view(sub.shape), sub), (name, box)
            assert torch.equal(wants[1].staging, t.reshape(-1)[a:b]), (name, a, b)

    piece = manifest.tensors["model.down"].pieces[-1]
    _flipped_byte_is_caught(root, STEP5, piece)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=4), "cannot hold a grid"),
        (lambda d: d["tensors"]["model.down"].update(grid=[[0, 3, 5], [0, 4, 4, 7]]), "rise"),
        (lambda d: d["tensors"]["model.down"].update(grid=[[0, 3, 5]]), "each of the 2 dims"),
        (lambda d: d["tensors"]["model.down"].update(grid=[[0, 3, 6], [0, 4, 7]]), "rise"),
        (lambda d: d["tensors"]["model.down"].update(grid=[[0, 1, 3, 5], [0, 4, 7]]), "4 cells"),
    ],
)
def test_v5_a_bad_grid_is_refused(edit: Any, message: str) -> None:
    from ftsdp.storage.format._manifest import Manifest
    from tests.make_storage_golden_v5 import GOLDEN_V5
    from tests.make_storage_golden_v5 import STEP as STEP5

    doc = json.loads((GOLDEN_V5 / f"step-{STEP5}" / "manifest.json").read_bytes())
    edit(doc)
    data = json.dumps(seal(doc)).encode()
    with pytest.raises(storage.CorruptCheckpointError, match=message):
        Manifest.from_json(data, where="edited golden v5")
