"""Writes tests/golden/storage_v5/, the golden checkpoint of storage format version 5 (tensors
saved on a grid: DTensor shards that are boxes of several dims, saved by 4 ranks on a 2 x 2 mesh).

Run once, from the repository root: ``python -m tests.make_storage_golden_v5``. Do NOT regenerate
it when the code changes: it pins the grid order that readers must keep reading
(tests/unit/storage/format/test_golden.py).
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import torch

from ftsdp import storage

GOLDEN_V5 = pathlib.Path(__file__).parent / "golden" / "storage_v5"
STEP = 13
WORLD = 4
MESH = (2, 2)
# Tiny objects and blocks: ranks write several objects, pieces span several blocks and objects.
OPTIONS = storage.SaveOptions(object_bytes=64, checksum_block_bytes=32, replica_split_bytes=96)


def reference() -> dict[str, torch.Tensor]:
    """The whole tensors: closed-form values, no RNG."""
    return {
        "down": torch.arange(35, dtype=torch.float32).reshape(5, 7) / 4,
        "up": torch.arange(24, dtype=torch.float32).reshape(8, 3) - 7,
        "cols": (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 2).to(torch.bfloat16),
        "cube": torch.arange(48, dtype=torch.int32).reshape(2, 4, 6) * 3,
        "bias": torch.arange(6, dtype=torch.float64) - 2.5,
        "even": (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8).to(torch.float16),
    }


def placements() -> dict[str, tuple]:
    """Each tensor's placements on the (dp, tp) mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "down": (Shard(0), Shard(1)),  # a row-parallel linear under FSDP2: 2-D boxes, uneven
        "up": (_StridedShard(0, split_factor=2), Shard(0)),  # column-parallel: row slabs
        "cols": (Replicate(), Shard(1)),  # column blocks held twice
        "cube": (Shard(2), Shard(1)),  # 3 dims
        "bias": (Shard(0), Replicate()),
        "even": (Shard(0), Shard(1)),  # rank r holds cell r of equal cells: a layout rule
    }


def rank_state(rank: int, world: int) -> dict[str, Any]:
    """What rank ``rank`` holds: each tensor as a DTensor of its placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ftsdp.storage.format._grid import dtensor_grid

    mesh = init_device_mesh("cpu", MESH)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    state: dict[str, Any] = {}
    for name, full in reference().items():
        p = placements()[name]
        box, _ = dtensor_grid(full.shape, MESH, coordinate, p)
        local = full[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))].clone()
        state[name] = DTensor.from_local(local, mesh, p, shape=full.shape, stride=full.stride())
    return {"model": state, "trainer": {"step": STEP, "rank": rank}}


def _write(rank: int, world: int, root: str) -> None:
    storage.save(rank_state(rank, world), root, step=STEP, options=OPTIONS)


def main() -> None:
    from ftsdp.testing import run_ranks

    shutil.rmtree(GOLDEN_V5, ignore_errors=True)
    run_ranks("tests.make_storage_golden_v5:_write", WORLD, str(GOLDEN_V5))


if __name__ == "__main__":
    main()
