"""Hostile hf and torch sources (issue 29, item 6): ``inspect`` and ``convert`` exit 2 with one
line, never 3, and ``convert --to ftsdp`` commits nothing a reader would refuse."""

from __future__ import annotations

import io
import json
import pathlib
import struct
import sys
from collections.abc import Callable

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.conversion import _sources
from ftsdp.storage.io._fs import Store
from ftsdp.tools.ckpt import main

W = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def _safetensors(path: pathlib.Path, header: dict) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))


def _deep_torch(path: pathlib.Path) -> None:
    root = inner = {}
    for _ in range(3000):
        inner["a"] = {}
        inner = inner["a"]
    inner["t"] = torch.zeros(2)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # the pickler recurses; the reader must not
    try:
        torch.save(root, path)
    finally:
        sys.setrecursionlimit(limit)


DEEP = "[" * 200_000 + "]" * 200_000
CASES: dict[str, tuple[str, Callable[[pathlib.Path], None], str]] = {
    "shape abcd": (
        "x.safetensors",
        lambda p: _safetensors(p, {"w": {**W, "shape": "abcd"}}),
        "shape 'abcd', not a list of non-negative integers",
    ),
    "shape [-1,-4]": (
        "x.safetensors",
        lambda p: _safetensors(p, {"w": {**W, "shape": [-1, -4]}}),
        "shape [-1, -4], not a list of non-negative integers",
    ),
    "dtype not a string": (
        "x.safetensors",
        lambda p: _safetensors(p, {"w": {**W, "dtype": 5}}),
        "dtype 5, not a string",
    ),
    "__metadata__ a list": (
        "x.safetensors",
        lambda p: _safetensors(p, {"__metadata__": ["a"], "w": W}),
        "__metadata__ must map strings to strings",
    ),
    "ftsdp.values [1,2]": (
        "x.safetensors",
        lambda p: _safetensors(p, {"__metadata__": {"ftsdp.values": "[1,2]"}, "w": W}),
        "not a JSON object of named values",
    ),
    "ftsdp.values 200k deep": (
        "x.safetensors",
        lambda p: _safetensors(p, {"__metadata__": {"ftsdp.values": DEEP}, "w": W}),
        "__metadata__['ftsdp.values'] nests JSON arrays or objects too deeply",
    ),
    "header 200k deep": (
        "x.safetensors",
        lambda p: p.write_bytes(struct.pack("<Q", len(DEEP)) + DEEP.encode()),
        "header nests JSON arrays or objects too deeply",
    ),
    "hf index 200k deep": (
        "hfdir",
        lambda p: (p.mkdir(), (p / "model.safetensors.index.json").write_text(DEEP)),
        "index nests JSON arrays or objects too deeply",
    ),
    "torch dict 3000 deep": ("x.pt", _deep_torch, "nests dicts or lists deeper than 64 levels"),
}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _files(folder: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_source_is_one_line_and_exit_2_and_commits_nothing(
    tmp_path: pathlib.Path, case: str
) -> None:
    name, make, message = CASES[case]
    src = tmp_path / "in" / name
    src.parent.mkdir()
    make(src)
    for argv in (
        ["inspect", str(src)],
        ["inspect", str(src), "--json"],
        ["convert", str(src), str(tmp_path / "out"), "--to", "ftsdp"],
        ["convert", str(src), str(tmp_path / "out-hf"), "--to", "hf"],
    ):
        code, out, err = _cli(*argv)
        assert code == 2, (argv, out, err)
        assert err.count("\n") == 1 and err.startswith("ftsdp-ckpt: error: "), err
        assert message in err, err
        assert out == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "out-hf").exists()


def test_the_ftsdp_sink_commits_only_what_a_reader_accepts(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's own check, whatever a source lets through: a header reader that passes a
    negative shape on (as it did before headers were checked) gets no step committed, and the
    attempt's objects are removed; without the hostile shape the same conversion commits a step
    that ``verify`` accepts and that loads the source's values."""
    src = tmp_path / "x.safetensors"
    ref = torch.arange(4, dtype=torch.float32)
    _safetensors(src, {"w": W})
    src.write_bytes(src.read_bytes()[:-16] + ref.numpy().tobytes())
    code, _, err = _cli("convert", str(src), str(tmp_path / "good"), "--to", "ftsdp", "-q")
    assert code == 0, err
    assert _cli("verify", str(tmp_path / "good"))[0] == 0
    target = {"w": torch.zeros(4)}
    storage.load(target, str(tmp_path / "good"))
    assert torch.equal(target["w"], ref)

    read_header = _sources.read_header

    def lax(store: Store, rel: str) -> tuple[dict, int]:
        header, base = read_header(store, rel)
        header["w"]["shape"] = [-1, -4]  # the same 16 bytes
        return header, base

    monkeypatch.setattr(_sources, "read_header", lax)
    out = tmp_path / "bad"
    code, _, err = _cli("convert", str(src), str(out), "--to", "ftsdp", "-q")
    assert code == 2, err
    assert err.count("\n") == 1 and "not committed, a reader would refuse it" in err, err
    assert "shape" in err, err
    assert _files(out) == []  # no manifest, no objects: nothing for gc or load to meet
