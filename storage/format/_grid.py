"""N-D layouts (docs/format.md, "The grid order"): a tensor cut into boxes along several dims is
stored cell by cell, so that every rank's box is one flat range of that order. Pieces, ranges and
layout rules are flat ranges of the grid order; only the copies between a region of the tensor and
the grid order (:func:`runs`) know about boxes."""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import Any, NamedTuple

from ftsdp.storage.format._ranges import Range

Cuts = tuple[tuple[int, ...], ...]  # per dim: (0, c_1, ..., size), strictly increasing


class Box(NamedTuple):
    """Elements ``offsets[d] <= i_d < offsets[d] + lengths[d]`` of a tensor."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


class Run(NamedTuple):
    """``rows`` runs of ``length`` elements: run ``i`` is elements ``[src + i * src_pitch, ...)``
    of the grid order, going to ``[dst + i * dst_pitch, ...)`` of the target's buffer."""

    src: int
    dst: int
    length: int
    rows: int = 1
    src_pitch: int = 0
    dst_pitch: int = 0


def strides(lengths: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (in elements) of a box of ``lengths``."""
    out = [1] * len(lengths)
    for d in range(len(lengths) - 2, -1, -1):
        out[d] = out[d + 1] * lengths[d + 1]
    return tuple(out)


def whole(shape: Sequence[int]) -> Cuts:
    """The grid of one cell: the plain row-major order."""
    return tuple((0, s) if s else (0,) for s in shape)


def is_plain(cuts: Cuts, shape: Sequence[int]) -> bool:
    """True when the grid order of ``cuts`` is the row-major order: only the first dim of more
    than one element is cut (or the tensor is empty)."""
    if 0 in shape:
        return True
    big = [d for d, s in enumerate(shape) if s > 1]
    return all(len(cuts[d]) == 2 for d in big[1:])


def check_cuts(cuts: Any, shape: Sequence[int], max_cells: int) -> str | None:
    """Why ``cuts`` (decoded JSON) is not a grid of ``shape``, or None."""
    if not (isinstance(cuts, (list, tuple)) and len(cuts) == len(shape)):
        return f"grid must list the cuts of each of the {len(shape)} dims"
    cells = 1
    for d, (c, size) in enumerate(zip(cuts, shape, strict=True)):
        if not (isinstance(c, (list, tuple)) and all(type(x) is int for x in c)):
            return f"grid dim {d} is not a list of integers"
        if not c or c[0] != 0 or c[-1] != size or any(a >= b for a, b in itertools.pairwise(c)):
            return f"grid dim {d} must rise strictly from 0 to its size {size}"
        cells *= max(len(c) - 1, 1)
        if cells > max_cells:
            return f"grid has more than {max_cells} cells (one per distinct shard at most)"
    return None


def cell_start(cuts: Cuts, shape: Sequence[int], index: Sequence[int]) -> int:
    """The first grid-order element of the cell at grid ``index``."""
    # Cells before it: those whose first differing grid index is smaller, dim by dim.
    start, before = 0, 1  # before: the elements of one cell's extent in the dims already fixed
    for d in range(len(shape)):
        lo, hi = cuts[d][index[d]], cuts[d][index[d] + 1]
        start += before * lo * math.prod(shape[d + 1 :])
        before *= hi - lo
    return start


def box_range(cuts: Cuts, shape: Sequence[int], box: Box) -> Range:
    """The range in grid order of ``box``, which must be one cell of ``cuts`` (else ValueError)."""
    index = []
    for d, (o, n) in enumerate(zip(box.offsets, box.lengths, strict=True)):
        c = cuts[d]
        i = _position(c, o)
        if i is None or i + 1 >= len(c) or c[i + 1] != o + n:
            raise ValueError(f"box {tuple(box)} is not one cell of the grid {cuts} (dim {d})")
        index.append(i)
    return Range(cell_start(cuts, shape, index), box.numel)


def _position(c: Sequence[int], x: int) -> int | None:
    """The index of cut ``x`` in ``c``, or None when ``x`` is not a cut."""
    i = bisect_left(c, x)
    return i if i < len(c) and c[i] == x else None


def flat_tiles(start: int, length: int, shape: Sequence[int]) -> list[tuple[Box, int]]:
    """Row-major elements ``[start, start + length)`` of ``shape`` as boxes, each a contiguous run
    of them, with the run's first position (in ``[0, length)``): at most ``2 * ndim - 1``."""
    if length <= 0:
        return []
    if not shape:
        return [(Box((), ()), 0)]
    out: list[tuple[Box, int]] = []
    st = strides(shape)

    def split(lo: int, hi: int, d: int, prefix: tuple[int, ...]) -> None:
        # [lo, hi) are flat offsets inside the sub-tensor at ``prefix`` (dims < d fixed).
        if lo >= hi:
            return
        s = st[d]
        first, last = -(-lo // s), hi // s  # whole slices [first, last) of dim d
        rest = tuple(shape[d + 1 :])
        base = sum(p * q for p, q in zip(prefix, st, strict=False))
        if first >= last:  # inside one slice, or across one boundary
            k = lo // s
            if (k + 1) * s >= hi:
                split(lo - k * s, hi - k * s, d + 1, (*prefix, k))
            else:
                split(lo - k * s, s, d + 1, (*prefix, k))
                split(0, hi - (k + 1) * s, d + 1, (*prefix, k + 1))
            return
        if lo < first * s:
            split(lo - (first - 1) * s, s, d + 1, (*prefix, first - 1))
        box = Box((*prefix, first, *(0,) * len(rest)), (*(1,) * len(prefix), last - first, *rest))
        out.append((box, base + first * s - start))
        if hi > last * s:
            split(0, hi - last * s, d + 1, (*prefix, last))

    split(start, start + length, 0, ())
    out.sort(key=lambda t: t[1])
    return out


def grid_tiles(cuts: Cuts, shape: Sequence[int], start: int, length: int) -> list[tuple[Box, int]]:
    """Elements ``[start, start + length)`` of the grid order of ``cuts`` as boxes of the tensor,
    each a contiguous run of that order (row-major inside the box), with the run's first position
    (in ``[0, length)``), in order: :func:`flat_tiles` of each cell the range crosses."""
    out: list[tuple[Box, int]] = []
    end = start + length
    if length <= 0:
        return out
    ranges = [range(max(len(c) - 1, 1)) for c in cuts]
    for index in itertools.product(*ranges):  # the cells in grid order
        lo = tuple(cuts[d][i] for d, i in enumerate(index))
        lengths = tuple(
            c[i + 1] - c[i] if len(c) > 1 else 0 for c, i in zip(cuts, index, strict=True)
        )
        first = cell_start(cuts, shape, index)
        numel = math.prod(lengths)
        a, b = max(start, first), min(end, first + numel)
        if first >= end:
            break
        if a >= b:
            continue
        for tile, pos in flat_tiles(a - first, b - a, lengths):
            shifted = tuple(o + x for o, x in zip(lo, tile.offsets, strict=True))
            out.append((Box(shifted, tile.lengths), a - start + pos))
    return out


def runs(shape: Sequence[int], cuts: Cuts, tiles: Sequence[tuple[Box, int]]) -> list[Run]:
    """The runs copying the elements of ``tiles`` (each a box stored row-major from its
    position in the target's buffer) out of a tensor stored in the grid order of ``cuts``."""
    ndim = len(shape)
    out: list[Run] = []
    for tile, base in tiles:
        if ndim == 0:
            out.append(Run(0, base, 1))
            continue
        t_lo, t_len = tile.offsets, tile.lengths
        t_st = strides(t_len)
        ranges = []  # per dim: the cells overlapping the tile
        for d in range(ndim):
            c = cuts[d]
            lo = max(bisect_right(c, t_lo[d]) - 1, 0)
            hi = bisect_right(c, t_lo[d] + t_len[d] - 1)
            ranges.append(range(lo, min(hi, len(c) - 1)))
        for index in itertools.product(*ranges):
            c_lo = tuple(cuts[d][i] for d, i in enumerate(index))
            c_len = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(index))
            s_lo = tuple(max(a, b) for a, b in zip(t_lo, c_lo, strict=True))
            s_len = tuple(
                min(a + n, b + m) - lo
                for a, n, b, m, lo in zip(t_lo, t_len, c_lo, c_len, s_lo, strict=True)
            )
            if min(s_len) <= 0:
                continue
            c_st = strides(c_len)
            src0 = cell_start(cuts, shape, index) + sum(
                (s - c) * k for s, c, k in zip(s_lo, c_lo, c_st, strict=True)
            )
            dst0 = base + sum((s - t) * k for s, t, k in zip(s_lo, t_lo, t_st, strict=True))
            out.extend(_box_runs(s_len, c_len, t_len, c_st, t_st, src0, dst0))
    return out


def _box_runs(
    s_len: Sequence[int],
    c_len: Sequence[int],
    t_len: Sequence[int],
    c_st: Sequence[int],
    t_st: Sequence[int],
    src0: int,
    dst0: int,
) -> list[Run]:
    """The runs of a box of ``s_len`` inside a cell (``c_len``, ``c_st``) and a tile."""
    ndim = len(s_len)
    j = ndim - 1  # dims after j are whole in the cell and the tile: merged into one run
    while j > 0 and s_len[j] == c_len[j] == t_len[j]:
        j -= 1
    length = math.prod(s_len[j:])
    if j == 0:
        return [Run(src0, dst0, length)]
    count, outer = s_len[j - 1], [range(n) for n in s_len[: j - 1]]
    out = []
    for idx in itertools.product(*outer):
        src = src0 + sum(i * k for i, k in zip(idx, c_st, strict=False))
        dst = dst0 + sum(i * k for i, k in zip(idx, t_st, strict=False))
        out.append(Run(src, dst, length, count, c_st[j - 1], t_st[j - 1]))
    return out


def dtensor_grid(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Any
) -> tuple[Box, Cuts]:
    """This coordinate's box of a DTensor and the grid of every coordinate's boxes; ValueError
    when a shard is not a box or the boxes do not form a grid."""
    dims, cuts = _dim_layouts(shape, mesh_shape, placements)
    return _box_at(shape, dims, coordinate), cuts


def dtensor_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Any
) -> tuple[list[Box], Cuts]:
    """Every mesh coordinate's box of a DTensor (coordinates in row-major order) and the grid of
    them, each dim's spans computed once."""
    dims, cuts = _dim_layouts(shape, mesh_shape, placements)
    coordinates = itertools.product(*(range(n) for n in mesh_shape))
    return [_box_at(shape, dims, c) for c in coordinates], cuts


# per tensor dim: the mesh dims sharding it, and their coordinates -> the span [lo, hi) held
_DimLayout = tuple[list[int], dict[tuple[int, ...], tuple[int, int]]]


def _dim_layouts(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Any
) -> tuple[list[_DimLayout], Cuts]:
    """Each dim's spans at every coordinate of the mesh dims sharding it, and the grid; checks
    that every shard is a box and the boxes form a grid."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shards = (Shard, _StridedShard)
    for p in placements:
        if not isinstance(p, (*shards, Replicate)):
            raise ValueError(
                f"DTensor placement {p} is not supported (Partial sums are not a state: "
                "redistribute to Replicate() or Shard(d) before saving)"
            )
    dims: list[_DimLayout] = []
    cuts: list[tuple[int, ...]] = []
    for d, size in enumerate(shape):
        mesh_dims = [m for m, p in enumerate(placements) if isinstance(p, shards) and p.dim == d]
        spans = {
            coords: _dim_span(
                size, mesh_shape, dict(zip(mesh_dims, coords, strict=True)), placements, d
            )
            for coords in itertools.product(*(range(mesh_shape[m]) for m in mesh_dims))
        }
        held = [(lo, hi) for lo, hi in spans.values() if hi > lo]
        c = tuple(sorted({0, size, *(b for span in held for b in span)}))
        for lo, hi in held:  # every box spans exactly one cell of every dim
            if _position(c, hi) != _position(c, lo) + 1:  # type: ignore[operator]
                raise ValueError(f"the shards of dim {d} overlap without being equal")
        dims.append((mesh_dims, spans))
        cuts.append(c)
    return dims, tuple(cuts)


def _box_at(shape: Sequence[int], dims: list[_DimLayout], coordinate: Sequence[int]) -> Box:
    """The box held at mesh ``coordinate`` (an empty span gives offset 0, length 0)."""
    offsets, lengths = [], []
    for size, (mesh_dims, spans) in zip(shape, dims, strict=True):
        lo, hi = spans[tuple(coordinate[m] for m in mesh_dims)] if mesh_dims else (0, size)
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def _dim_span(
    size: int, mesh_shape: Sequence[int], coords: dict[int, int], placements: Any, d: int
) -> tuple[int, int]:
    """``[lo, hi)``: the indices of dim ``d`` held at mesh coordinates ``coords`` (of the mesh
    dims sharding ``d``); ValueError when they are not contiguous."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    local, index = size, None
    for m, p in enumerate(placements):
        if m in coords:
            local, index = _get_shard_size_and_offsets(
                local, mesh_shape[m], coords[m], p, index, size, False
            )
    if local == 0 or index is None:
        return (0, 0)
    values = index.tolist()
    lo = values[0]
    if values != list(range(lo, lo + local)):
        raise ValueError(
            f"the shard of dim {d} at mesh coordinates {coords} holds indices {values[:8]}"
            f"{'...' if len(values) > 8 else ''}: not a contiguous box"
        )
    return (lo, lo + local)
