"""What the restarted rank 0 finds in the slot directory of a dead persister is not trusted:
``recover`` commits nothing from a layout or slot that is not what it says, says why, and never
raises (the other ranks wait for rank 0 at the next collective)."""

from __future__ import annotations

import dataclasses
import json
import os

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
