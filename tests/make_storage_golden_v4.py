"""Writes tests/golden/storage_v4/, the golden checkpoint of storage format version 4 (tensors
described by a layout rule, saved by 3 ranks).

Run once, from the repository root: ``python -m tests.make_storage_golden_v4``. Do NOT regenerate
it when the code changes: a reader derives the pieces of a rule tensor by running the layout code
again, so this checkpoint pins that code (tests/unit/storage/format/test_golden.py).
"""

from __future__ import annotations

import math
import pathlib
import shutil
from typing import Any

import torch

from ftsdp import storage

GOLDEN_V4 = pathlib.Path(__file__).parent / "golden" / "storage_v4"
STEP = 11
WORLD = 3
# Tiny objects and blocks: ranks write several objects, pieces span several blocks and objects.
OPTIONS = storage.SaveOptions(object_bytes=64, checksum_block_bytes=32, replica_split_bytes=96)


def reference() -> dict[str, torch.Tensor]:
    """The whole tensors: closed-form values, no RNG."""
    return {
        "w": torch.arange(30, dtype=torch.float32).reshape(5, 6) / 8,
        "b": torch.arange(7, dtype=torch.float64) - 3.5,
        "rows": torch.arange(40, dtype=torch.int32).reshape(10, 4) * 3,
        "small": torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16),
        "big": torch.arange(48, dtype=torch.float32) * -0.5,
        "uneven": torch.arange(9, dtype=torch.int64),
    }


def rank_state(rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` of ``world`` holds: ``w`` and ``b`` as one FlatParameter (FlatShard
    with its layout), ``rows`` split by rows (Shard(0)), ``small`` and ``big`` whole on every
    rank, ``uneven`` cut at no rule (rank 0 holds 2 elements, the others the rest)."""
    ref = reference()
    flat: dict[str, Any] = {}
    chunk = -(-(ref["w"].numel() + ref["b"].numel()) // world)
    start = 0
    for name in ("w", "b"):
        t = ref[name]
        lo = min(max(rank * chunk - start, 0), t.numel())
        hi = min(max((rank + 1) * chunk - start, 0), t.numel())
        flat[name] = storage.FlatShard(t.shape, lo, t.reshape(-1)[lo:hi].clone(), (start, chunk))
        start += t.numel()
    per = -(-10 // world)
    rows = ref["rows"][rank * per : (rank + 1) * per].reshape(-1).clone()
    cuts = [0, 2, *(2 + math.ceil(7 * i / (world - 1)) for i in range(1, world))]
    uneven = ref["uneven"][cuts[rank] : cuts[rank + 1]].clone()
    return {
        "model": flat,
        "rows": storage.FlatShard((10, 4), rank * per * 4, rows),
        "small": ref["small"].clone(),
        "big": ref["big"].clone(),
        "uneven": storage.FlatShard((9,), cuts[rank], uneven),
        "trainer": {"step": STEP, "rank": rank},
    }


def _write(rank: int, world: int, root: str) -> None:
    storage.save(rank_state(rank, world), root, step=STEP, options=OPTIONS)


def main() -> None:
    from ftsdp.testing import run_ranks

    shutil.rmtree(GOLDEN_V4, ignore_errors=True)
    run_ranks("tests.make_storage_golden_v4:_write", WORLD, str(GOLDEN_V4))


if __name__ == "__main__":
    main()
