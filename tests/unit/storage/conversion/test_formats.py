"""The format table (storage/conversion/_formats.py) is the only place a format's name chooses code: every
entry point (convert, detection, the loaders, verify, inspect, diff) goes through its rows, the
detection order is the table's, and DCP's module is imported only for DCP checkpoints."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.conversion import _formats

REPO = pathlib.Path(__file__).resolve().parents[4]


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.randn(5, generator=g), "step": 3}


@pytest.fixture
def src(tmp_path: pathlib.Path) -> str:
    url = str(tmp_path / "src")
    storage.save(_state(), url, step=1)
    return url


def test_every_entry_point_dispatches_through_the_table(
    src: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    row = _formats._TABLE["torch"]

    def spy(what: str, fn: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            calls.append(what)
            return fn(*args)

        return wrapped

    monkeypatch.setitem(
        _formats._TABLE,
        "torch",
        dataclasses.replace(
            row,
            open=spy("open", row.open),
            sink=spy("sink", row.sink),
            detect=spy("detect", row.detect),
        ),
    )
    dst = str(tmp_path / "out.pt")
    storage.conversion.convert(src, dst, to="torch")
    assert calls == ["detect", "sink"]  # the source's detection asks torch's detector first
    calls.clear()
    assert storage.conversion.detect_format(dst) == "torch"
    got = storage.load_state_dict(dst)
    assert torch.equal(got["w"], _state()["w"])
    assert storage.catalog.verify(dst).ok
    assert storage.catalog.inspect_checkpoint(dst)["format"] == "torch"
    assert all(r["status"] == "same" for r in storage.catalog.diff(src, None, dst, None)["tensors"])
    assert calls.count("open") == 4 and calls.count("detect") >= 5, calls
    # Without its row's detector nothing else recognises the file.
    monkeypatch.setitem(
        _formats._TABLE, "torch", dataclasses.replace(row, detect=lambda probe: False)
    )
    with pytest.raises(ValueError, match="cannot tell the format of the file"):
        storage.conversion.detect_format(dst)


def test_detection_order(src: str, tmp_path: pathlib.Path) -> None:
    """A torch zip named .safetensors is torch; step dirs make an ftsdp root even next to
    .safetensors files and DCP's .metadata (never read there); DCP's .metadata wins in any other
    directory; hf is the fallback."""
    pt = tmp_path / "model.safetensors"
    torch.save({"w": torch.zeros(2)}, pt)
    assert storage.conversion.detect_format(str(pt)) == "torch"
    root = pathlib.Path(src)
    (root / "model.safetensors").write_bytes(b"")
    assert storage.conversion.detect_format(src) == "ftsdp"
    (root / ".metadata").write_bytes(b"")
    assert storage.conversion.detect_format(src) == "ftsdp"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.safetensors").write_bytes(b"")
    (tmp_path / "other" / ".metadata").write_bytes(b"")
    assert storage.conversion.detect_format(str(tmp_path / "other")) == "dcp"
    assert storage.conversion.FORMATS == ("ftsdp", "hf", "torch", "dcp")
    with pytest.raises(ValueError, match="unknown format 'npz'; known: ftsdp, hf, torch, dcp"):
        _formats.open_source(src, "npz")


@pytest.mark.timeout(120)
def test_dcp_is_imported_only_for_dcp(src: str, tmp_path: pathlib.Path) -> None:
    code = (
        "import sys\n"
        "from ftsdp import storage\n"
        "src, out = sys.argv[1:]\n"
        "for fmt in ('hf', 'torch', 'ftsdp'):\n"
        "    dst = f'{out}/{fmt}' + ('.pt' if fmt == 'torch' else '')\n"
        "    storage.conversion.convert(src, dst, to=fmt)\n"
        "    assert storage.conversion.detect_format(dst) == fmt\n"
        "    storage.load_state_dict(dst)\n"
        "assert 'torch.distributed.checkpoint' not in sys.modules\n"
        "storage.conversion.convert(src, f'{out}/dcp', to='dcp')\n"
        "assert 'torch.distributed.checkpoint' in sys.modules\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, src, str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_a_step_directory_is_refused_by_every_reader(tmp_path) -> None:
    """Its objects are safetensors files, but read as hf they would skip the manifest and its
    checksums: every reader refuses the step directory and names the way to read it."""
    root = tmp_path / "ck"
    storage.save({"w": torch.arange(6.0)}, str(root), step=3)
    step_dir = str(root / "step-3")
    for read in (
        lambda: storage.load_state_dict(step_dir),
        lambda: storage.LazyStateDict(step_dir),
        lambda: storage.conversion.convert(step_dir, str(tmp_path / "out"), to="hf"),
        lambda: storage.catalog.diff(step_dir, None, str(root), 3),
    ):
        with pytest.raises(ValueError, match="is a step directory of an ftsdp checkpoint"):
            read()
    assert not (tmp_path / "out").exists()


def test_metadata_files_are_read_within_bounds(tmp_path) -> None:
    """An hf index or DCP ``.metadata`` that is a FIFO (or anything whose size is not its
    content) is never read past its size: the reader fails instead of blocking forever."""
    import os
    import threading

    for name, extra in (("model.safetensors.index.json", "x.safetensors"), (".metadata", None)):
        folder = tmp_path / name.strip(".")
        folder.mkdir()
        os.mkfifo(folder / name)
        if extra:
            (folder / extra).write_bytes(b"")
        outcome: list[BaseException | None] = []

        def read(folder=folder, outcome=outcome) -> None:
            try:
                storage.load_state_dict(str(folder))
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=20)
        assert outcome, f"reading {name} blocked on a FIFO"
        assert isinstance(outcome[0], storage.CheckpointError), outcome
