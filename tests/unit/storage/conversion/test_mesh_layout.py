"""Serving a tensor in a grid order other than the saved one (``reshard --mesh``): ``grid_tiles``
against the grid order built by slicing, ``Feed`` in requests far smaller than a cell from an
ftsdp source (box reads) and an hf one (rows read and cut), and ``mesh_layout``'s ranks."""

from __future__ import annotations

import itertools
import math
import pathlib
import random

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.conversion._formats import open_source
from ftsdp.storage.conversion._interfaces import Feed, OutTensor
from ftsdp.storage.conversion._mesh import mesh_layout, parse_placements
from ftsdp.storage.format._grid import dtensor_boxes, dtensor_grid, grid_tiles
from ftsdp.storage.io._streaming import Meter
from tests.make_storage_golden_v5 import GOLDEN_V5, reference


def _grid_order(t: torch.Tensor, cuts: list[list[int]]) -> torch.Tensor:
    """``t``'s elements cell by cell (row-major over the grid), row-major in each cell."""
    cells = itertools.product(*(range(len(c) - 1) for c in cuts))
    parts = [
        t[tuple(slice(cuts[d][i], cuts[d][i + 1]) for d, i in enumerate(index))].reshape(-1)
        for index in cells
    ]
    return torch.cat(parts)


def test_grid_tiles_cover_any_range_in_grid_order() -> None:
    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        cuts = [
            [0, *sorted(rng.sample(range(1, s), rng.randint(0, min(3, s - 1)))), s] for s in shape
        ]
        t = torch.arange(math.prod(shape)).reshape(shape)
        order = _grid_order(t, cuts)
        a = rng.randint(0, order.numel())
        b = rng.randint(a, order.numel())
        got = torch.full((b - a,), -1)
        tiles = grid_tiles(tuple(map(tuple, cuts)), shape, a, b - a)
        assert len(tiles) <= max(1, math.prod(len(c) - 1 for c in cuts)) * (2 * len(shape) - 1)
        for box, at in tiles:
            region = tuple(slice(o, o + n) for o, n in zip(*box, strict=True))
            got[at : at + box.numel] = t[region].reshape(-1)
        assert torch.equal(got, order[a:b]), (shape, cuts, a, b)


def test_feed_serves_another_grid_order(tmp_path: pathlib.Path) -> None:
    """Requests of 6 bytes (a few elements, crossing the cells of both grids) of the golden's
    tensors in new grid orders equal the reference's elements in those orders: read as boxes
    where the new cells are whole rows of the saved ones, else through their rows, cut."""
    hf = str(tmp_path / "hf")
    storage.conversion.convert(str(GOLDEN_V5), hf, to="hf")
    new = {  # grids unlike the saved ones; exact: read as boxes from the ftsdp source
        "model.down": ([[0, 1, 4, 5], [0, 2, 7]], False),  # cols cut where the saved are not
        "model.up": ([[0, 3, 8], [0, 1, 3]], False),  # saved row-major
        "model.cube": ([[0, 1, 2], [0, 4], [0, 1, 5, 6]], False),
        "model.bias": ([[0, 2, 5, 6]], True),  # 1-D: every box is a run
        "model.even": ([[0, 1, 3, 4], [0, 3, 6]], True),  # rows across the saved cells
        "model.cols": ([[0, 1, 4], [0, 6]], True),  # a box spans 2 saved cells' whole rows
    }
    for url in (str(GOLDEN_V5), hf):
        source = open_source(url, None, None, None, 1 << 20)
        try:
            outputs = [OutTensor(source.tensors[n], n) for n in new]
            feed = Feed(source, outputs, 6, Meter(0, None))
            for name, (cuts, exact) in new.items():
                feed.set_grid(name, tuple(map(tuple, cuts)))
                assert feed.grids[name][1] == (exact and url == str(GOLDEN_V5)), name
                full = reference()[name.removeprefix("model.")]
                parts = list(feed.stream(feed.requests(name, 0, full.numel())))
                assert len(parts) > 1 and torch.equal(torch.cat(parts), _grid_order(full, cuts))
        finally:
            source.close()


def test_mesh_layout_ranks_and_uneven_chunks() -> None:
    """Rank r is the r-th coordinate, row-major; torch's chunking leaves the last ranks empty."""
    grid, ranges = mesh_layout((5, 4), (4, 2), parse_placements("S0,S1", 2))
    assert grid == ((0, 2, 4, 5), (0, 2, 4))
    # cells in grid order: rows 0-1 (2 cells of 4), rows 2-3 (2 of 4), row 4 (2 of 2)
    assert [(r.offset, r.length) if r else None for r in ranges] == [
        (0, 4), (4, 4), (8, 4), (12, 4), (16, 2), (18, 2), None, None,
    ]  # fmt: skip
    grid, ranges = mesh_layout((6,), (2, 3), parse_placements("R,S0", 2))
    assert (
        grid is None and [(r.offset, r.length) for r in ranges if r] == [(0, 2), (2, 2), (4, 2)] * 2
    )


def test_dtensor_boxes_are_torchs_shards_at_every_coordinate() -> None:
    """The boxes of all coordinates at once equal torch's own local shape and offset of each
    coordinate (``_compute_local_shape_and_global_offset``), and ``dtensor_grid``'s, for the
    golden's placements (strided shards too) on meshes of uneven splits."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from tests.make_storage_golden_v5 import placements

    shapes = {"down": (5, 7), "up": (8, 3), "cols": (4, 6), "cube": (2, 4, 6), "bias": (6,)}
    for mesh in ((2, 2), (3, 2), (2, 4)):
        for name, shape in shapes.items():
            p = placements()[name]
            boxes, cuts = dtensor_boxes(shape, mesh, p)
            coordinates = list(itertools.product(*(range(n) for n in mesh)))
            assert len(boxes) == len(coordinates)
            for box, coordinate in zip(boxes, coordinates, strict=True):
                local, offset = _compute_local_shape_and_global_offset(
                    shape, mesh, list(coordinate), p
                )
                assert box.lengths == tuple(local), (name, mesh, coordinate)
                if box.numel:
                    assert box.offsets == tuple(offset), (name, mesh, coordinate)
                assert (box, cuts) == dtensor_grid(shape, mesh, coordinate, p), (name, mesh)


def test_a_mesh_of_more_ranks_than_a_layout_may_plan_is_refused() -> None:
    from ftsdp.storage.conversion._mesh import MAX_MESH_RANKS, check_mesh

    assert check_mesh((1024, 1024)) == (1024, 1024) and 1024 * 1024 == MAX_MESH_RANKS
    with pytest.raises(ValueError, match="more than"):
        check_mesh((100000, 100000))
