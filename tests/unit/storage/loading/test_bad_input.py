"""Bad input: each a clear error, and nothing partially loaded."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.format._manifest import SELF_CHECKSUM, seal
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._local import LocalStore
from tests.make_storage_golden import GOLDEN, STEP

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


def _edit(root: Path, fn: Callable[[dict], None], reseal: bool = True) -> None:
    """Edit the manifest; ``reseal`` recomputes its checksum, so that the edit reaches the
    structural checks (without it, the checksum catches every edit first)."""
    path = root / "step-1" / "manifest.json"
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(seal(doc) if reseal else doc))


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
    "newer version": (
        lambda d: d.update(version=storage.format.FORMAT_VERSION + 1),
        storage.NewerFormatError,
        "newer",
    ),
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
    "key names another place": (
        lambda d: _w(d)[0].update(key="w@999"),
        storage.CorruptCheckpointError,
        "keyed 'w@999'",
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
        lambda d: _w(d)[0].update(crc32c=[]),
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
    # hostile metadata: each was a crash, a wrong exception or a pass before the bounds
    "name ends in a newline": (
        lambda d: _rename(d, _w(d)[0]["object"] + "\n"),
        storage.CorruptCheckpointError,
        "escapes",
    ),
    "huge shape": (
        lambda d: d["tensors"]["w"].update(shape=[2**62] * 300),
        storage.CorruptCheckpointError,
        "more than 2\\*\\*63-1 elements",
    ),
    "offset past 2**63": (
        lambda d: _w(d)[0].update(offset=2**64),
        storage.CorruptCheckpointError,
        "offset must be a non-negative",
    ),
    "attempt not a string": (
        lambda d: d.update(attempt={"x": [1]}),
        storage.CorruptCheckpointError,
        "attempt=.* is not a string",
    ),
    "checksum field malformed": (
        lambda d: d.update({SELF_CHECKSUM: "crc"}),
        storage.CorruptCheckpointError,
        "manifest_checksum must be",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_manifest(ckpt: Path, case: str) -> None:
    edit, error, match = CASES[case]
    _edit(ckpt, edit, reseal=case != "checksum field malformed")
    target = _blank()
    with pytest.raises(error, match=match) as err:
        storage.load(target, str(ckpt))
    assert "manifest.json" in str(err.value) or case == "newer version"
    _untouched(target)


def test_manifest_not_json(ckpt: Path) -> None:
    (ckpt / "step-1" / "manifest.json").write_text("{not json")
    with pytest.raises(storage.CorruptCheckpointError, match="not valid JSON"):
        storage.load(_blank(), str(ckpt))


def _raw(root: Path, fn: Callable[[str], str]) -> None:
    """Edit the manifest's text (JSON a decoder cannot always hold), then seal it."""
    path = root / "step-1" / "manifest.json"
    path.write_text(fn(path.read_text()))


def test_deeply_nested_manifest(ckpt: Path) -> None:
    """100,000 nested arrays: the JSON decoder's RecursionError is a CorruptCheckpointError."""
    deep = "[" * 100_000 + "]" * 100_000
    _raw(ckpt, lambda t: t.replace('"values":{', f'"values":{{"deep":{deep},'))
    target = _blank()
    with pytest.raises(storage.CorruptCheckpointError, match="too deeply"):
        storage.load(target, str(ckpt))
    _untouched(target)
    with pytest.raises(storage.CorruptCheckpointError, match="too deeply"):
        storage.load_state_dict(str(ckpt))


def test_nesting_cap_is_configurable(ckpt: Path) -> None:
    """Nesting the decoder can hold but past max_json_depth is refused; the cap is an option."""
    storage.save({**_ref(), "cfg": [[[[[1]]]]]}, str(ckpt), step=2, options=OPTS)
    target = {**_blank(), "cfg": None}
    with pytest.raises(storage.CorruptCheckpointError, match="max_json_depth=6"):
        storage.load(target, str(ckpt), options=storage.LoadOptions(max_json_depth=6))
    _untouched(target)
    storage.load(target, str(ckpt))
    assert target["cfg"] == [[[[[1]]]]]
    for depth in (100, 500):  # deeper than the default, each decodable: refused by the walk
        value = "[" * depth + "]" * depth
        _raw(ckpt, lambda t, v=value: t.replace('"values":{', f'"values":{{"d":{v},'))
        with pytest.raises(storage.CorruptCheckpointError, match="deeper than max_json_depth=64"):
            storage.load_state_dict(str(ckpt), step=1)
    nested: list = []
    for _ in range(70):
        nested = [nested]
    with pytest.raises(ValueError, match="nest deeper than a manifest may"):  # never written
        storage.save({"a": torch.zeros(1), "v": nested}, str(ckpt), step=3)
    assert storage.list_steps(str(ckpt)) == [1, 2]


def test_huge_integer_in_manifest(ckpt: Path) -> None:
    """A 5,000-digit integer (past Python's int-string limit) is a CorruptCheckpointError."""
    _raw(ckpt, lambda t: t.replace('"values":{', f'"values":{{"n":{"9" * 5000},'))
    target = _blank()
    with pytest.raises(storage.CorruptCheckpointError, match="not valid JSON"):
        storage.load(target, str(ckpt))
    _untouched(target)


def test_manifest_size_is_capped_before_reading(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An oversized manifest is refused from its size, without reading it."""
    size = (ckpt / "step-1" / "manifest.json").stat().st_size
    reads: list[str] = []
    real_read, real_range = Store.read, Store.read_range
    monkeypatch.setattr(Store, "read", lambda s, rel="": reads.append(rel) or real_read(s, rel))
    monkeypatch.setattr(
        Store, "read_range", lambda s, rel, a, b: reads.append(rel) or real_range(s, rel, a, b)
    )
    target = _blank()
    small = storage.LoadOptions(max_manifest_bytes=size - 1)
    with pytest.raises(storage.CorruptCheckpointError, match="larger than max_manifest_bytes"):
        storage.load(target, str(ckpt), options=small)
    _untouched(target)
    assert not [r for r in reads if r.endswith("manifest.json")]
    storage.load(target, str(ckpt), options=storage.LoadOptions(max_manifest_bytes=size))
    assert target["step"] == 3
    # The default cap (1 GiB): a store that reports a 2 GiB manifest is refused unread, whether
    # its size comes from asking for it or from the listing of its step.
    real_size, real_listdir = LocalStore.size, LocalStore.listdir  # the local backend's own

    def listdir(s: LocalStore, rel: str = "") -> dict[str, tuple[str, int]]:
        listing = real_listdir(s, rel)
        if "manifest.json" in listing:
            listing["manifest.json"] = (listing["manifest.json"][0], 2 << 30)
        return listing

    monkeypatch.setattr(LocalStore, "listdir", listdir)
    monkeypatch.setattr(
        LocalStore,
        "size",
        lambda s, rel="": 2 << 30 if rel.endswith("manifest.json") else real_size(s, rel),
    )
    reads.clear()
    with pytest.raises(storage.CorruptCheckpointError, match="2147483648 bytes is larger"):
        storage.load(_blank(), str(ckpt))
    with pytest.raises(storage.CorruptCheckpointError, match="2147483648 bytes is larger"):
        storage.load_state_dict(str(ckpt))
    assert not [r for r in reads if r.endswith("manifest.json")]


def test_manifest_checksum_catches_edits(ckpt: Path) -> None:
    """Edits that leave a consistent manifest (a float32 tensor relabelled int32, a changed
    value) are caught by the manifest's checksum of its own content: load, load_state_dict and
    verify refuse; the same edit resealed is what a deliberate editor could write."""
    doc = json.loads((ckpt / "step-1" / "manifest.json").read_text())
    assert doc[SELF_CHECKSUM]["algorithm"] == "crc32c"
    for edit in (
        lambda d: d["tensors"]["w"].update(dtype="int32"),
        lambda d: d["values"].update(step=4),
        lambda d: _w(d)[0]["crc32c"].__setitem__(0, _w(d)[0]["crc32c"][0] ^ 1),
    ):
        storage.save(_ref(), str(ckpt / "c"), step=1, options=OPTS)
        _edit(ckpt / "c", edit, reseal=False)
        target = _blank()
        with pytest.raises(storage.CorruptCheckpointError, match="manifest checksum mismatch"):
            storage.load(target, str(ckpt / "c"))
        _untouched(target)
        with pytest.raises(storage.CorruptCheckpointError, match="manifest checksum mismatch"):
            storage.load_state_dict(str(ckpt / "c"))
        report = storage.catalog.verify(str(ckpt / "c"))
        assert not report.ok and "manifest checksum mismatch" in report.problems[0]
        shutil.rmtree(ckpt / "c")


def test_verify_checks_dtype_against_object_headers(ckpt: Path) -> None:
    """A resealed relabel (same item size, F32 -> I32) passes the manifest's own checks, but
    verify compares every piece with its object's safetensors header."""
    _edit(ckpt, lambda d: d["tensors"]["w"].update(dtype="int32"))
    report = storage.catalog.verify(str(ckpt))
    assert not report.ok
    assert any("'F32' of shape" in p and "'I32'" in p and "(int32)" in p for p in report.problems)
    assert storage.catalog.verify(str(ckpt), 1).problems == report.problems


def test_manifest_checksum_is_required_from_version_2(ckpt: Path, tmp_path: Path) -> None:
    """Manifests of version 2 on must carry the checksum (else one damaged byte in its key would
    switch the check off); version 1 manifests, written before it, load without one, and one
    that has it is checked."""
    assert json.loads((ckpt / "step-1" / "manifest.json").read_text())["version"] == 3
    _edit(ckpt, lambda d: d.update(manifest_chesksum=d.pop(SELF_CHECKSUM)), reseal=False)
    target = _blank()
    with pytest.raises(storage.CorruptCheckpointError, match="must carry manifest_checksum"):
        storage.load(target, str(ckpt))
    _untouched(target)
    assert "must carry manifest_checksum" in storage.catalog.verify(str(ckpt)).problems[0]
    # Version 1, as its writer wrote it (tests/golden/storage_v1: no manifest checksum).
    v1 = tmp_path / "v1"
    shutil.copytree(GOLDEN, v1)
    path = v1 / f"step-{STEP}" / "manifest.json"
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and SELF_CHECKSUM not in doc
    assert storage.catalog.verify(str(v1)).ok
    path.write_text(json.dumps(seal({**doc, "values": {**doc["values"], "x": 4}})))
    assert storage.catalog.verify(str(v1)).ok  # present: checked in version 1 too
    doc = json.loads(path.read_text())
    doc["values"]["x"] = 5
    path.write_text(json.dumps(doc))
    with pytest.raises(storage.CorruptCheckpointError, match="manifest checksum mismatch"):
        storage.load_state_dict(str(v1))


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


@pytest.mark.parametrize(
    ("value", "keys"),
    [
        ([{1: "a", "1": "b"}], "1 and '1'"),
        ([[{"x": {True: 1, "true": 2}}]], "True and 'true'"),
        ((0, {None: 1, "null": 2}), "None and 'null'"),
    ],
)
def test_a_value_whose_dict_keys_json_would_merge_is_refused(
    tmp_path: Path, value: Any, keys: str
) -> None:
    """JSON writes ``1`` and ``"1"`` as one key: one value would come back, silently."""
    url = str(tmp_path)
    with pytest.raises(ValueError, match=rf"v: keys {keys} of a dict in this value are one key"):
        storage.save({"w": torch.ones(2), "v": value}, url, step=0)
    assert storage.list_steps(url) == []
    # keys JSON keeps apart are saved; those that are not strings come back as strings
    storage.save({"w": torch.ones(2), "v": [{1: "a", 2: "b"}]}, url, step=0)
    target: dict[str, Any] = {"w": torch.zeros(2), "v": None}
    storage.load(target, url)
    assert target["v"] == [{"1": "a", "2": "b"}]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_names_the_file_it_could_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """An object write failing with ENOSPC said only "No space left on device"; the error now
    names the file (and stays an OSError of that errno), and nothing is committed."""
    import errno

    from ftsdp.storage.format import _safetensors

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_safetensors, "write_object", full)
    monkeypatch.setattr("ftsdp.storage.saving._save.write_object", full, raising=False)
    url = str(tmp_path / "root")
    with pytest.raises(OSError, match=r"No space left on device: .*step-3/.*\.safetensors") as e:
        handle = storage.save({"w": torch.ones(10)}, url, 3, async_save=async_save)
        if handle is not None:
            handle.wait()
    assert e.value.errno == errno.ENOSPC
    assert storage.list_steps(url) == []


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_failed_leaves_none_of_its_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """The second of four objects fails (ENOSPC): the other three were written and stayed
    beside the failed attempt until retention or ``gc``, taking the room a retry needs. Now the
    failed save removes them (and its empty step directory); the retry commits, and the files
    already in the root are untouched."""
    import errno

    from ftsdp.storage.saving import _save

    real, calls = _save.write_object, []

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    url = str(tmp_path / "root")
    storage.save({"w": torch.ones(3)}, url, 1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    state = {f"w{i}": torch.full((1 << 16,), float(i)) for i in range(4)}
    options = storage.SaveOptions(object_bytes=1 << 18)  # one object per tensor
    monkeypatch.setattr(_save, "write_object", second_fails)
    with pytest.raises(OSError, match="No space left on device"):
        handle = storage.save(state, url, 3, options=options, async_save=async_save)
        if handle is not None:
            handle.wait()
    assert len(calls) == 4  # every object was tried: three were written, then removed
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    storage.save(state, url, 3, options=options)
    assert storage.list_steps(url) == [1, 3]
    loaded = storage.load_state_dict(url, 3)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_verify_of_a_large_step_lists_every_mismatch_in_order(tmp_path: Path) -> None:
    """Past 16 MiB of data verify checks parts on several threads (a local object in parts of
    32 MiB of its mapped pages): every damaged block is still listed, in the order one thread
    would list them (tensor, then byte offset), also past a piece's first part."""
    state = {"a": torch.arange(10 << 20, dtype=torch.float32), "b": torch.ones(3 << 20)}
    url = str(tmp_path / "big")
    storage.save(state, url, step=1)
    manifest = storage.catalog.read_manifest(url)
    hits = []
    for name, at in (("b", 5 << 20), ("a", 37 << 20), ("a", 1 << 20), ("a", 9 << 20)):
        piece = next(p for p in manifest.tensors[name].pieces if p.byte_start + at < p.byte_end)
        path = tmp_path / "big" / "step-1" / piece.object
        data = bytearray(path.read_bytes())
        data[piece.byte_start + at] ^= 1
        path.write_bytes(bytes(data))
        hits.append((name, piece.byte_start + at))
    problems = storage.catalog.verify(url).problems
    assert len(problems) == 4, problems
    for problem, (name, at) in zip(problems, sorted(hits), strict=True):
        assert f"tensor {name}: checksum mismatch" in problem, problems
        start = int(problem.split("bytes [")[1].split(",")[0])
        assert start <= at < start + manifest.checksum_block_bytes, (problem, at)


def test_a_manifest_that_is_a_directory_is_refused_as_not_a_file(ckpt: Path) -> None:
    """The step's listing finds ``manifest.json``, a directory: the load says so, unread."""
    manifest = ckpt / "step-1" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()
    target = _blank()
    with pytest.raises(storage.CorruptCheckpointError, match="the manifest is not a file"):
        storage.load(target, str(ckpt), step=1)
    _untouched(target)


@pytest.mark.parametrize("step", [True, False, -1, 1.0, "1", None])
def test_a_step_that_is_not_a_non_negative_int_is_refused_by_every_call(
    ckpt: Path, step: Any
) -> None:
    """``True == 1`` in Python, and a float or a str formats into a directory name: each would
    read or write ``step-True``, ``step-1.0``. Every call that takes a step refuses them alike
    (None means the newest step where a load takes it, never for a save)."""
    target = _blank()
    loads: list[Callable[[], Any]] = [
        lambda: storage.load(target, str(ckpt), step=step),
        lambda: storage.load_state_dict(str(ckpt), step=step),
        lambda: storage.LazyStateDict(str(ckpt), step=step),
        lambda: storage.load_into(torch.nn.Linear(1, 1), str(ckpt), step=step),
    ]
    calls = [lambda: storage.save(_ref(), str(ckpt), step=step)]
    if step is not None:
        calls += loads
    for call in calls:
        with pytest.raises(ValueError, match="must be a non-negative int"):
            call()
    _untouched(target)
    assert storage.list_steps(str(ckpt)) == [1]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-1"]


def test_a_target_on_the_meta_device_is_named_not_skipped(ckpt: Path) -> None:
    """A meta tensor holds no values: a load into it would report success and fill nothing.
    It is refused by name (strict) or reported as mismatched (strict=False), and the rest of
    the target is loaded only in the second case."""
    target = {**_blank(), "w": torch.empty(40, device="meta")}
    with pytest.raises(storage.StateMismatchError, match=r"w \(target on the meta device"):
        storage.load(target, str(ckpt))
    assert not target["b"].any() and target["step"] == 0
    result = storage.load(target, str(ckpt), strict=False)
    assert [m.split(" ")[0] for m in result.mismatched] == ["w"]
    assert torch.equal(target["b"], _ref()["b"]) and target["step"] == 3


def test_names_that_only_read_as_a_step_are_not_steps(ckpt: Path) -> None:
    """``step-01``, ``step-\u0661`` (an Arabic-Indic one) and ``step-1`` followed by a newline
    are other directories, not step 1 again (a root may hold other directories): each step is
    listed once, ``step-09`` is no torn step 9, and garbage collection leaves them alone."""
    from ftsdp.storage import catalog

    for name in ("step-01", "step-\u0661", "step-1\n", "step-09", "step-+2", "step- 3"):
        (ckpt / name).mkdir()
    assert storage.list_steps(str(ckpt)) == [1]
    info = catalog.inspect_checkpoint(str(ckpt))
    assert info["committed_steps"] == [1] and info["torn_steps"] == [], info
    assert catalog.verify(str(ckpt)).ok
    catalog.collect_garbage(str(ckpt), keep_last=1)
    assert len(list(ckpt.iterdir())) == 8  # step-1, latest and the six others
    target = _blank()
    storage.load(target, str(ckpt))
    assert target["step"] == 3


@pytest.mark.parametrize("async_save", [False, True])
def test_conjugate_and_negative_views_save_their_values(tmp_path: Path, async_save: bool) -> None:
    """A conjugate view (and the imaginary part of one, a negative view) is saved with the
    values torch gives when it is read, not its storage's (the save failed inside torch)."""
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    state = {"conj": c.conj(), "neg": c.conj().imag}
    storage.save(state, str(tmp_path), 1, async_save=async_save).wait()
    got = storage.load_state_dict(str(tmp_path))
    assert torch.equal(got["conj"], c.conj().resolve_conj())
    assert torch.equal(got["neg"], torch.tensor([-2.0, 1.0]))
