"""[Note: the save exchange] (docs/format.md, "Commit protocol", step 1): every rank issues the
same collectives in the same order and raises the same error; nothing grows with the world size
on any rank but rank 0 (regular layouts agreed by digests, the rest gathered to rank 0)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._dtypes import dtype_name
from ftsdp.storage.format._layout import object_name
from ftsdp.storage.format._objects import PlannedObject, PlannedPiece
from ftsdp.storage.format._regular import IRREGULAR, RegularLayout, infer_rule, resolve
from ftsdp.storage.format._state import TensorLeaf
from ftsdp.storage.io import _collectives
from ftsdp.storage.saving._save_plan import SavePlan, make_plan, renamed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_IRREGULAR = ["irregular"]


def exchange(
    leaves: dict[str, TensorLeaf],
    meta: dict[str, Any],
    group: ProcessGroup | None,
    step: int,
    options: SaveOptions,
    wire: Any = _collectives,
) -> tuple[SavePlan, dict[str, Any], int]:
    """The plan of ``step``, this rank's values and the world size; collective over ``group``.
    ``meta``: this rank's ``error``, ``values`` and (rank 0) ``attempt`` and ``replaces``;
    ``wire``: the collectives (the scale simulation's stand-ins). Raises the same error on every
    rank when a rank failed, the steps differ or the ranges do not fit together."""
    rank, world = wire.rank_world(group)
    error = meta.get("error")
    values = meta.get("values", {}) if error is None else {}
    table: list[list[Any]] = []  # [name, shape, dtype, rule] per tensor, in name order
    rules: list[int] = []
    for name, t in sorted(leaves.items()) if error is None else ():
        # every rule irregular for a single rank: nothing to gain there
        rule = infer_rule(t.shape, t.range, rank, world, t.layout) if world > 1 else IRREGULAR
        table.append([name, list(t.shape), dtype_name(t.dtype), rule.as_json()])
        rules += [_KINDS[rule.kind], *((rule.start, rule.chunk) if rule.kind == "even" else (0, 0))]
    # Ranks whose options pack objects differently would derive other ranks' objects unlike
    # those written (a committed step no reader could derive): such tables never agree.
    grids = {n: t.grid for n, t in leaves.items() if t.grid is not None} if error is None else {}
    shaped = [
        world,
        options.object_bytes,
        options.replica_split_bytes,
        [r[:3] for r in table],
        sorted(grids.items()),
    ]
    mine = {
        "failed": error is not None,
        "step": step,
        "block": options.checksum_block_bytes,
        "tensors": _digest(shaped),
        "rules": _digest(rules),
        "attempt": meta.get("attempt"),
        "replaces": meta.get("replaces"),
    }
    head = wire.broadcast_json(mine, group)  # rank 0's (the others' own go nowhere)
    failed, mismatched, other_tensors, other_rules = wire.all_reduce_max(
        [
            int(error is not None),
            int((mine["step"], mine["block"]) != (head["step"], head["block"])),
            int(mine["tensors"] != head["tensors"]),
            int(mine["rules"] != head["rules"]),
        ],
        group,
    )
    if failed or mismatched:
        report = {"error": error, "step": step, "block": options.checksum_block_bytes}
        _raise_for(wire.all_gather_json(report, group), step)
    attempt, replaces = head["attempt"], head["replaces"]
    assert attempt is not None  # rank 0 made one (fresh_attempt), or the save failed above
    agreed = not other_tensors  # the same tensors everywhere: then compare their rules
    if agreed and world > 1 and other_rules:
        both = wire.all_reduce_max([*rules, *(-v for v in rules)], group)
        n = len(rules)
        same = [both[i] == -both[n + i] for i in range(n)]
        # a rule not every rank agreed on is made irregular
        table = [
            r if all(same[3 * i : 3 * i + 3]) else [*r[:3], _IRREGULAR] for i, r in enumerate(table)
        ]
    regular: RegularLayout | None = None
    mine_objects: list[PlannedObject] = []
    if agreed:
        layout = resolve(table, world, options.object_bytes, options.replica_split_bytes)
        if layout.entries:  # some tensor has a rule
            regular, mine_objects = layout, layout.rank_objects(rank, attempt)
    irregular = {row[0] for row in table if row[3] == _IRREGULAR} if agreed else set(leaves)
    # The same on every rank (``irregular`` is not, when the tables differ: a rank may hold
    # none of the tensors, and once skipped the gather and scatter its peers waited in).
    coordinate = bool(irregular) if agreed else True
    listed: list[PlannedObject] = []
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    if coordinate:
        send = {"tensors": tensor_rows(leaves, irregular), "first": len(mine_objects)}
        gathered = wire.gather_json(send, group)
        shares: list[Any] | None = None
        if rank == 0 and gathered is not None:
            listed, shapes, shares, listed_grids = _coordinate(gathered, attempt, options, world)
            grids = {**grids, **listed_grids}
        share = wire.scatter_json(shares, group)
        if isinstance(share, dict):
            raise ValueError(share["error"])
        if rank != 0:
            listed = _objects(rank, len(mine_objects), attempt, share, leaves)
        mine_objects = mine_objects + [o for o in listed if o.rank == rank]
    plan = SavePlan(attempt, shapes, listed, regular, mine_objects, replaces, grids)
    return plan, values, world


def _raise_for(reports: list[dict[str, Any]], step: int) -> None:
    """Raise, on every rank alike, the first failure, step or checksum block difference."""
    for r, m in enumerate(reports):
        if m["error"]:
            raise CheckpointError(f"save of step {step} failed on rank {r}: {m['error']}")
    steps = [m["step"] for m in reports]
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"the ranks are not saving the same step (steps by rank: {steps}): a save failed on "
            "some ranks only and the loop went on; restart the job from its last checkpoint"
        )
    blocks = sorted({m["block"] for m in reports})
    raise CheckpointError(
        f"save of step {step}: the ranks checksum blocks of {blocks[0]} to {blocks[-1]} bytes "
        "(SaveOptions.checksum_block_bytes); pass the same SaveOptions on every rank"
    )


def _digest(doc: Any) -> str:
    """A 64-bit hex digest of a JSON-able ``doc``."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


_KINDS = {"irregular": 0, "whole": 1, "even": 2}


def tensor_rows(leaves: dict[str, TensorLeaf], names: Collection[str]) -> list[list[Any]]:
    """``[name, shape, dtype, offset, length]`` of the leaves named in ``names``, by name, and
    the grid of a leaf on one (``make_plan``)."""
    return [
        [n, list(t.shape), dtype_name(t.dtype), t.range.offset, t.range.length]
        + ([] if t.grid is None else [t.grid])
        for n, t in sorted(leaves.items())
        if n in names
    ]


def _coordinate(
    gathered: list[dict[str, Any]], attempt: str, options: SaveOptions, world: int
) -> tuple[list[PlannedObject], dict[str, tuple[tuple[int, ...], str]], list[Any], dict]:
    """Rank 0: the plan of the irregular tensors, each rank's share (or an error for all), and
    the grids of every rank's tensors."""
    try:
        plan = make_plan([{"tensors": g["tensors"]} for g in gathered], attempt, options)
    except ValueError as e:
        return [], {}, [{"error": str(e)}] * world, {}
    first = {r: g["first"] for r, g in enumerate(gathered)}
    listed = renamed(plan.objects, attempt, first)
    shares: list[list[Any]] = [[] for _ in range(world)]
    for o in listed:
        shares[o.rank].append([[p.name, p.offset, p.length] for p in o.pieces])
    return listed, plan.shapes, shares, plan.grids


def _objects(
    rank: int, first: int, attempt: str, share: list[Any], leaves: dict[str, TensorLeaf]
) -> list[PlannedObject]:
    """This rank's listed objects from its share of the coordinator's plan."""
    return [
        PlannedObject.laid_out(
            object_name(rank, first + i, attempt),
            rank,
            [PlannedPiece(n, o, ln, leaves[n].dtype) for n, o, ln in pieces],
        )
        for i, pieces in enumerate(share)
    ]
