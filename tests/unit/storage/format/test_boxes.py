"""Reading boxes and flat ranges out of any saved order (storage/format/_grid.py and the reader):
random shapes, grids, boxes and flat ranges, checked against slicing the tensor itself.

The grid arithmetic is checked on its own (a tensor laid out in grid order by torch, runs applied
by hand); the reader end to end on checkpoints saved in small objects and small checksum blocks
and read in small parts, so that a copy of rows with gaps is cut by pieces, blocks and parts at
arbitrary places."""

from __future__ import annotations

import itertools
import math
import pathlib
import random

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.format._grid import Box, box_range, flat_tiles, runs, whole
from ftsdp.storage.format._ranges import Range
from ftsdp.storage.io._fs import Store
from ftsdp.storage.loading._read_plan import make_want, plan_reads
from ftsdp.storage.loading._reader import execute


def _grid_order(x: torch.Tensor, cuts: tuple) -> torch.Tensor:
    cells = itertools.product(*(range(len(c) - 1) for c in cuts))
    parts = [
        x[tuple(slice(c[i], c[i + 1]) for c, i in zip(cuts, idx, strict=True))] for idx in cells
    ]
    return torch.cat([p.reshape(-1) for p in parts])


def _random_region(rng: random.Random, shape: tuple) -> tuple[Box | None, Range]:
    if rng.random() < 0.5:
        numel = math.prod(shape)
        a = rng.randrange(numel)
        return None, Range(a, rng.randint(a + 1, numel) - a)
    lo = tuple(rng.randrange(n) for n in shape)
    return Box(lo, tuple(rng.randint(1, n - o) for n, o in zip(shape, lo, strict=True))), Range(
        0, 0
    )


def _expected(x: torch.Tensor, box: Box | None, rng: Range) -> torch.Tensor:
    if box is None:
        return x.reshape(-1)[rng.offset : rng.end]
    return x[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))].reshape(-1)


def test_runs_copy_any_box_or_range_out_of_any_grid_order() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(0, 4)))
        x = torch.arange(math.prod(shape)).reshape(shape)
        cuts = tuple(
            tuple(sorted({0, n} | {rng.randint(0, n) for _ in range(rng.randint(0, 2))}))
            for n in shape
        )
        saved = _grid_order(x, cuts) if shape else x.reshape(-1)
        for idx in itertools.product(*(range(len(c) - 1) for c in cuts)):
            cell = Box(
                tuple(c[i] for c, i in zip(cuts, idx, strict=True)),
                tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx, strict=True)),
            )
            start, n = box_range(cuts, shape, cell)
            assert torch.equal(saved[start : start + n], _expected(x, cell, Range(0, 0)))
        if not shape:
            continue
        box, flat = _random_region(rng, shape)
        tiles = [(box, 0)] if box is not None else flat_tiles(*flat, shape)
        want = _expected(x, box, flat)
        for order, data in ((cuts, saved), (whole(shape), x.reshape(-1))):
            out = torch.full_like(want, -1)
            for r in runs(shape, order, tiles):
                for i in range(r.rows):
                    s, d = r.src + i * r.src_pitch, r.dst + i * r.dst_pitch
                    out[d : d + r.length] = data[s : s + r.length]
            assert torch.equal(out, want), (shape, order, box, flat)


@pytest.mark.parametrize("seed", range(3))
def test_the_reader_fills_random_boxes_and_ranges_bitwise(
    tmp_path: pathlib.Path, seed: int
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "w": torch.randn(37, 29, generator=gen),
        "cube": torch.randint(0, 1000, (5, 7, 11), generator=gen, dtype=torch.int64),
        "h": torch.randn(13, 17, generator=gen).to(torch.float16),
    }
    options = storage.SaveOptions(
        object_bytes=rng.choice([96, 400, 4096]), checksum_block_bytes=16 * rng.randint(1, 8)
    )
    storage.save(tensors, str(tmp_path), 1, options=options)
    manifest = storage.catalog.read_manifest(str(tmp_path))
    io = storage.IOOptions(part_bytes=rng.choice([64, 256, 1 << 20]), threads=2)
    store = Store(str(tmp_path), None, io)
    for _ in range(60):
        name = rng.choice(sorted(tensors))
        x = tensors[name]
        box, flat = _random_region(rng, tuple(x.shape))
        want = make_want(name, manifest.tensors[name], flat, box)
        execute(store, manifest, plan_reads([want], manifest.checksum_block_bytes))
        assert torch.equal(want.staging, _expected(x, box, flat)), (name, box, flat)
