"""Saves, commits and load plans of thousands of synthetic ranks in one process, through the
real storage code (for ``python -m ftsdp.tools.dev.simulate_scale``; see docs/benchmarks.md).

Nothing here writes or reads data and no process group exists: each function runs the code a
rank runs around the collectives of a save (see [Note: the save exchange] in _exchange.py),
rank 0's commit from every rank's done marker, or a rank's read planning, for ranks of a
world of any size whose state is made of ``meta`` tensors.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import torch

from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._manifest import Manifest
from ftsdp.storage.format._ranges import Range
from ftsdp.storage.format._state import TensorLeaf
from ftsdp.storage.loading._load import _match
from ftsdp.storage.loading._read_plan import plan_reads
from ftsdp.storage.saving import _exchange
from ftsdp.storage.saving._commit import build_manifest
from ftsdp.storage.saving._save_plan import SavePlan, make_plan

# A transformer block's shapes, cycled: attention and MLP weights, a norm, a bias.
SHAPES = [(1024, 1024), (1024,), (2816, 1024), (1024, 2816), (1024, 1024), (2816,)]
UNIT = len(SHAPES)  # tensors per FlatParameter unit (ftsdp's flat layout)
ATTEMPT = "0123abcd"


ROW_SCALE = 1  # multiplies every shape's first dimension (more rows: Shard(0) spans more ranks)


def shapes(tensors: int) -> dict[str, tuple[int, ...]]:
    """T tensor names and shapes, in units of ``UNIT`` (name order is unit order)."""
    return {
        f"u{i // UNIT:04d}.t{i % UNIT}": (SHAPES[i % UNIT][0] * ROW_SCALE, *SHAPES[i % UNIT][1:])
        for i in range(tensors)
    }


def leaves(layout: str, world: int, rank: int, tensors: int) -> dict[str, TensorLeaf]:
    """Rank ``rank``'s tensors under ``layout`` (``meta`` tensors: no data)."""
    out = {}
    names = shapes(tensors)
    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(name.split(".")[0], []).append(name)
    for members in units.values():
        total = sum(math.prod(names[n]) for n in members)
        chunk = -(-total // world)
        start = 0
        for name in members:
            shape = names[name]
            numel = math.prod(shape)
            if layout == "flat":
                hint: tuple[int, int] | None = (start, chunk)
                lo = min(max(rank * chunk - start, 0), numel)
                hi = min(max((rank + 1) * chunk - start, 0), numel)
            else:
                hint, row = None, numel // shape[0]
                rows = -(-shape[0] // world)
                lo = min(rank * rows, shape[0]) * row
                hi = min((rank + 1) * rows, shape[0]) * row
            local = torch.empty(hi - lo, device="meta")
            out[name] = TensorLeaf(name, shape, torch.float32, Range(lo, hi - lo), local, hint)
            start += numel
    return out


def sample_ranks(world: int, n: int) -> list[int]:
    """``n`` ranks spread over ``world`` (first and last included)."""
    return sorted({round(i * (world - 1) / max(n - 1, 1)) for i in range(n)})


class Wire:
    """The collectives of one rank of a simulated save in which every rank holds the same
    tensors under the same rules: each returns what the real one returns there, and counts the
    payload bytes this rank sends and receives (``nbytes``). Rank 0 receives every rank's
    gathered message (here a copy of its own)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.nbytes = rank, world, 0

    def rank_world(self, group: Any) -> tuple[int, int]:
        return self.rank, self.world

    def all_reduce_max(self, values: list[int], group: Any) -> list[int]:
        self.nbytes += 2 * 8 * len(values)  # sent and received
        return list(values)

    def broadcast_json(self, obj: Any, group: Any) -> Any:
        # Rank 0's header; elsewhere this rank's own (the same tensors and rules) with rank 0's
        # attempt.
        data = json.dumps(obj if self.rank == 0 else {**obj, "attempt": ATTEMPT, "replaces": None})
        self.nbytes += len(data)
        return json.loads(data)

    def all_gather_json(self, obj: Any, group: Any) -> list[Any]:
        data = json.dumps(obj)
        self.nbytes += len(data) * (self.world + 1)
        return [json.loads(data) for _ in range(self.world)]

    def gather_json(self, obj: Any, group: Any) -> list[Any] | None:
        data = json.dumps(obj)
        if self.rank:
            self.nbytes += len(data)
            return None
        self.nbytes += len(data) * self.world
        return [json.loads(data) for _ in range(self.world)]

    def scatter_json(self, objs: Any, group: Any) -> Any:
        # Tensors without an agreed rule: a rank's share comes from the coordinator's plan of
        # every rank's ranges, which one simulated rank does not have. The synthetic states
        # (``leaves``) always agree, so a call here is a state this module cannot simulate.
        raise ValueError(
            "simulated ranks hold tensors without an agreed layout rule: the coordinator's "
            "share of another rank cannot be simulated; use the flat or shard0 layouts"
        )


def plan_rank(
    held: dict[str, TensorLeaf], world: int, rank: int, options: SaveOptions
) -> tuple[SavePlan, int]:
    """One rank's exchange and planning of a save of ``held``: the real
    ``storage._exchange.exchange`` on a :class:`Wire`. Returns the plan and the bytes this
    rank exchanged."""
    meta = {"error": None, "values": {}, "attempt": ATTEMPT, "replaces": None}
    wire = Wire(rank, world)
    plan, _, _ = _exchange.exchange(held, meta, None, 1, options, wire)
    return plan, wire.nbytes


def old_planning(layout: str, world: int, tensors: int, options: SaveOptions) -> tuple[float, int]:
    """The replaced protocol: every rank's metadata all-gathered to every rank and planned."""
    metas = []
    for r in range(world):
        held = leaves(layout, world, r, tensors)
        metas.append({"tensors": _exchange.tensor_rows(held, held)})
    gathered = sum(len(json.dumps(m)) for m in metas)
    start = time.perf_counter()
    make_plan(metas, ATTEMPT, options)
    return time.perf_counter() - start, gathered


def markers(layout: str, world: int, tensors: int, options: SaveOptions) -> tuple[Any, ...]:
    """What rank 0 holds once every rank's done marker is in: the plan, every regular object's
    checksums (made up), each rank's object count and their sizes."""
    regular = plan_rank(leaves(layout, world, 0, tensors), world, 0, options)[0].regular
    counts, sizes, crcs = [], {}, {}
    for rank in range(world):
        objects = regular.rank_objects(rank, ATTEMPT)
        counts.append(len(objects))
        for obj in objects:
            sizes[obj.name] = obj.size
            crcs[obj.name] = [
                [(rank * 7919 + i) & 0xFFFFFFFF] * -(-(e - s) // options.checksum_block_bytes)
                for i, (s, e) in enumerate(obj.byte_ranges)
            ]
    return SavePlan(ATTEMPT, {}, [], regular=regular), crcs, counts, sizes


def commit_manifest(inputs: tuple[Any, ...], world: int, options: SaveOptions) -> Manifest:
    """Rank 0's commit: the manifest from every rank's done marker (``markers``)."""
    plan, crcs, counts, sizes = inputs
    return build_manifest(
        plan,
        crcs,
        step=1,
        world_size=world,
        checksum_block_bytes=options.checksum_block_bytes,
        values={},
        rank_values=[{}] * world,
        regular=(counts, sizes),
    )


def load_planning(found: Manifest, layout: str, world: int, rank: int, tensors: int) -> float:
    """Rank ``rank`` of ``world`` planning its reads of ``found`` (fresh derivations)."""
    target = leaves(layout, world, rank, tensors)
    for name, leaf in target.items():  # _match stages into real tensors of the saved dtype
        target[name] = TensorLeaf(name, leaf.shape, leaf.dtype, leaf.range, torch.empty(0))
    start = time.perf_counter()
    wants, _, _, _ = _match(found, target, {}, rank, cast=False)
    plan_reads(wants, found.checksum_block_bytes)
    return time.perf_counter() - start
