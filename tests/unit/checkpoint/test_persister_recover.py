"""What the restarted rank 0 finds in the slot directory of a dead persister is not trusted:
``recover`` commits nothing from a layout or slot that is not what it says, says why, and never
raises (the other ranks wait for rank 0 at the next collective)."""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from ftsdp import storage
from ftsdp.checkpoint import _persister as p


def test_no_layout_is_nothing_to_recover(tmp_path) -> None:
    assert p.recover(str(tmp_path), str(tmp_path / "memory")) == ([], [])


def test_a_garbled_layout_is_said_and_not_raised(tmp_path) -> None:
    (tmp_path / p.LAYOUT).write_text('{"rows": 3}')
    committed, problems = p.recover(str(tmp_path), str(tmp_path / "memory"))
    assert committed == [] and len(problems) == 1 and p.LAYOUT in problems[0]


def test_a_complete_record_over_a_truncated_slot_is_refused(tmp_path) -> None:
    rows = [[["w", [4, 4], "float32", 0, 16, None]]]
    options = dataclasses.asdict(storage.SaveOptions())
    (tmp_path / p.LAYOUT).write_text(json.dumps({"id": 1, "rows": rows, "options": options}))
    (tmp_path / os.path.basename(p.record_file("", 0, 0))).write_text(
        json.dumps({"step": 5, "layout": 1, "memory_values": {}})
    )
    (tmp_path / os.path.basename(p.slot_file("", 0, 0, 0))).write_bytes(b"\0" * 10)  # too short
    memory = tmp_path / "memory"
    committed, problems = p.recover(str(tmp_path), str(memory))
    assert committed == [] and len(problems) == 1 and "step 5 in slot 0" in problems[0]
    assert not memory.exists() or storage.list_steps(str(memory)) == []


def test_the_persister_imports_nothing_from_the_working_directory(tmp_path) -> None:
    """A job started in a directory another user can write to (a shared /tmp): a module
    planted there under a name the persister imports must not run. Python puts the working
    directory first on the path of a ``-c`` program; the persister's command leaves it out."""
    import subprocess

    from ftsdp.checkpoint._snapshots import persister_command

    marker = tmp_path / "ran.txt"
    for name in ("uuid", "queue", "ftsdp"):  # the first two imported before anything of ours
        planted = tmp_path / (f"{name}/__init__.py" if name == "ftsdp" else f"{name}.py")
        planted.parent.mkdir(exist_ok=True)
        planted.write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    proc = subprocess.run(
        persister_command(), cwd=tmp_path, input=b"", capture_output=True, timeout=120
    )
    assert not marker.exists(), marker.read_text()
    # it got as far as reading its (here empty) configuration: the real modules were imported
    assert proc.returncode != 0 and b"JSONDecodeError" in proc.stderr, proc.stderr[-2000:]


def test_a_failed_memory_commit_leaves_no_links_behind(tmp_path, monkeypatch) -> None:
    """A memory commit links the slot files into the memory root: one that fails (here its
    manifest write, on a full shared memory) removes its links, else each failure would keep a
    slot file's old bytes alive in shared memory until some later commit succeeded."""
    from ftsdp.storage.saving import _shares

    rows = [[["w", [4, 4], "float32", 0, 16, None]], [["v", [2, 2], "float32", 0, 4, None]]]
    options = storage.SaveOptions()
    (tmp_path / p.LAYOUT).write_text(
        json.dumps({"id": 1, "rows": rows, "options": dataclasses.asdict(options)})
    )
    p._Slots(str(tmp_path), p.plan_for_ranks(rows, 0, options), (0,))  # laid out, zeros
    for rank in range(2):
        with open(p.record_file(str(tmp_path), rank, 0), "w") as f:
            json.dump({"step": 7, "layout": 1, "memory_values": {}}, f)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_shares, "commit", full)
    memory = tmp_path / "memory"
    committed, problems = p.recover(str(tmp_path), str(memory))
    assert committed == [] and len(problems) == 1 and "No space" in problems[0]
    assert not memory.exists() or os.listdir(memory) == []
    slot_files = [f for f in tmp_path.iterdir() if f.name.startswith("r") and ".o" in f.name]
    assert len(slot_files) == 2 and all(f.stat().st_nlink == 1 for f in slot_files)
    monkeypatch.undo()  # the next try commits the slot, which holds what was copied
    assert p.recover(str(tmp_path), str(memory)) == ([7], [])
    assert torch.equal(storage.load_state_dict(str(memory))["w"], torch.zeros(4, 4))
