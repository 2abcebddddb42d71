"""Laying a checkpoint out as ranks on an N-D device mesh would have saved it (``reshard`` with
``mesh``; docs/cli.md, "Resharding to a mesh"): each tensor gets DTensor placements (a default,
or the first ``(pattern, spec)`` rule whose fnmatch pattern matches its name), each rank the box
its mesh coordinate holds, and the tensor the grid of those boxes (storage/format/_grid.py)."""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

from ftsdp.storage.format._grid import Cuts, box_range, dtensor_boxes, is_plain
from ftsdp.storage.format._ranges import Range

MAX_MESH_RANKS = 1 << 20  # a layout is planned per rank: a typo must not plan billions
_SPEC = re.compile(r"S(\d+)|R")

# (fnmatch pattern, placements): a spec "S0,R" or a sequence of torch placements
PlacementRules = Sequence[tuple[str, Any]]


def check_mesh(mesh: Any) -> tuple[int, ...]:
    """``mesh`` as a tuple of mesh dim sizes (each an int >= 1); ValueError otherwise."""
    if not isinstance(mesh, (list, tuple)) or not mesh:
        raise ValueError(f"mesh={mesh!r} must be a non-empty sequence of mesh dim sizes")
    if not all(type(n) is int and n >= 1 for n in mesh):
        raise ValueError(f"mesh={mesh!r}: every mesh dim size must be an int >= 1")
    if math.prod(mesh) > MAX_MESH_RANKS:
        raise ValueError(f"mesh={mesh!r} has more than {MAX_MESH_RANKS} ranks")
    return tuple(mesh)


def parse_placements(spec: Any, mesh_ndim: int) -> tuple[Any, ...]:
    """``"S0,R"`` -> ``(Shard(0), Replicate())``: one placement per mesh dim, ``S<d>`` shards
    tensor dim ``d`` over that mesh dim, ``R`` replicates over it; a sequence of torch
    ``Shard`` / ``Replicate`` objects is taken as it is. ValueError for anything else."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(spec, str):
        out: list[Any] = []
        for part in spec.split(","):
            m = _SPEC.fullmatch(part.strip())
            if m is None:
                raise ValueError(
                    f"placements {spec!r}: {part.strip()!r} is neither S<dim> (Shard) nor R "
                    "(Replicate)"
                )
            out.append(Replicate() if m.group(1) is None else Shard(int(m.group(1))))
    else:
        out = list(spec)
        bad = [p for p in out if type(p) not in (Shard, Replicate)]
        if bad:
            raise ValueError(f"placements {spec!r}: {bad[0]} is not Shard(d) or Replicate()")
    if len(out) != mesh_ndim:
        raise ValueError(
            f"placement spec {spec!r} gives {len(out)} placements for the {mesh_ndim} dims of the "
            "mesh"
        )
    return tuple(out)


def placements_for(name: str, ndim: int, mesh: Sequence[int], rules: PlacementRules) -> tuple:
    """The placements of tensor ``name`` (``ndim`` dims): the first rule whose pattern matches
    it (fnmatch, case-sensitive), else the default (docs/cli.md: mesh dim ``m`` shards tensor dim
    ``m`` while the tensor has one, else replicates); ValueError when they shard a dim the tensor
    does not have."""
    for pattern, spec in rules:
        if fnmatch.fnmatchcase(name, pattern):
            out = parse_placements(spec, len(mesh))
            break
    else:
        from torch.distributed.tensor import Replicate, Shard

        return tuple(Shard(m) if m < ndim else Replicate() for m in range(len(mesh)))
    for p in out:
        if hasattr(p, "dim") and not 0 <= p.dim < ndim:
            raise ValueError(
                f"tensor {name!r} ({ndim} dims) cannot take placements {spec!r} (rule "
                f"{pattern!r}): it has no dim {p.dim}"
            )
    return out


@functools.lru_cache(maxsize=1024)  # a model's layers share shapes and placements
def mesh_layout(
    shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple
) -> tuple[Cuts | None, tuple[Range | None, ...]]:
    """The grid of a tensor of ``shape`` under ``placements`` on ``mesh`` (None when its order
    is the row-major one), and each rank's range of that order (None: it holds nothing). Rank
    ``r`` is at the ``r``-th mesh coordinate in row-major order, as a ``DeviceMesh`` of
    ``torch.arange(world).reshape(mesh)`` places it."""
    if math.prod(shape) == 0:  # nothing to hold: rank 0 lists it
        return None, (Range(0, 0), *[None] * (math.prod(mesh) - 1))
    boxes, cuts = dtensor_boxes(shape, mesh, placements)
    ranges = tuple(box_range(cuts, shape, box) if box.numel else None for box in boxes)
    return (None if is_plain(cuts, shape) else cuts), ranges
