"""Writes tests/golden/storage_v1/, the golden checkpoint of storage format version 1.

Run once, from the repository root: ``python -m tests.make_storage_golden``. Do NOT regenerate it
when the format changes: the point of the golden checkpoint is that every future version of
``storage`` still reads what version 1 wrote (tests/unit/storage/format/test_golden.py).
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import torch

from ftsdp import storage

GOLDEN = pathlib.Path(__file__).parent / "golden" / "storage_v1"
STEP = 7
# Tiny objects and checksum blocks, so the golden step has several objects and multi-block pieces.
OPTIONS = storage.SaveOptions(object_bytes=64, checksum_block_bytes=32)


def golden_state() -> dict[str, Any]:
    """The state saved in the golden checkpoint: closed-form values, no RNG."""
    return {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
            "b": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),
            "big": torch.arange(20, dtype=torch.float64) * -0.5,
        },
        "optim": {"step": torch.tensor(7, dtype=torch.int64), "mask": torch.tensor([1, 0, 1]) > 0},
        "trainer": {"step": STEP, "name": "golden", "cursor": [3, None, 1.25]},
    }


def main() -> None:
    shutil.rmtree(GOLDEN, ignore_errors=True)
    storage.save(golden_state(), str(GOLDEN), step=STEP, options=OPTIONS)


if __name__ == "__main__":
    main()
