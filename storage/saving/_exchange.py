"""The metadata exchange of a save, and its plan: small and independent of the world size for
regular layouts, gathered to one coordinator for the rest.

[Note: the save exchange]
Every rank of a save, on the same group and in the same order:
  1. an all-reduce (max) of eleven integers: whether it failed to describe its state, the step
     (and its negation: min and max together), the digest of its tensors' names, shapes and
     dtypes and of the options that shape its objects (and its negation), its checksum block
     size (and its negation), the digest of its rules (and its negation), and from rank 0 the
     attempt id as a number with whether a broadcast must follow. A failure or differing
     steps turn into one all-gather of the errors, so that every rank raises the same
     message; differing block sizes raise on every rank (one manifest, one size);
  2. only when rank 0 said so (it replaces an earlier commit of the step, or its attempt id
     does not fit in a number): a broadcast from rank 0 of the attempt id and the attempt it
     replaces;
  3. only when the tensors are the same everywhere but the rules' digests differ: a second
     all-reduce of each tensor's rule as three integers (and their negations), which finds the
     rules every rank agrees on, compared exactly; a tensor whose rule differs somewhere (a
     rank holding it whole where the others hold parts) has none. That is 48 bytes per tensor;
  4. only when some tensor has no agreed rule: a gather to rank 0 of the ranges of those
     tensors, with the number of regular objects the rank writes, and a scatter from rank 0 of
     each rank's share of the plan of those tensors.
With agreed rules a rank plans its regular objects from the table alone (see [Note: regular
layouts] in _regular.py), kept between saves: a repeated save costs the table's key and one
all-reduce. The ranks' JSON values are not exchanged here: each rank other than rank 0 reports
its own in its done marker with its checksums, and rank 0 keeps in the manifest those that
differ from its own (storage/saving/_commit.py). Nothing here grows with the world size on a rank
other than rank 0, and rank 0 receives only the irregular ranges.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ftsdp.storage._errors import CheckpointError
from ftsdp.storage._options import SaveOptions
from ftsdp.storage.format._dtypes import dtype_name
from ftsdp.storage.format._kept import Kept
from ftsdp.storage.format._layout import object_name
from ftsdp.storage.format._regular import RegularLayout, infer_rule, resolve, table_digest
from ftsdp.storage.format._safetensors import layout as safetensors_layout
from ftsdp.storage.format._state import TensorLeaf
from ftsdp.storage.io import _collectives
from ftsdp.storage.saving._save_plan import (
    PlannedObject,
    PlannedPiece,
    SavePlan,
    make_plan,
    renamed,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_IRREGULAR = ["irregular"]


def rule_table(leaves: dict[str, TensorLeaf], rank: int, world: int) -> list[list[Any]]:
    """This rank's rule table: ``[name, shape, dtype, rule]`` per tensor in name order (every
    rule ``irregular`` for a single rank: nothing to gain there)."""
    rows = []
    for name, leaf in sorted(leaves.items()):
        if world < 2:
            rule = _IRREGULAR
        else:
            rule = infer_rule(leaf.shape, leaf.range, rank, world, leaf.layout).as_json()
        rows.append([name, list(leaf.shape), dtype_name(leaf.dtype), rule])
    return rows


def exchange(
    leaves: dict[str, TensorLeaf],
    meta: dict[str, Any],
    group: ProcessGroup | None,
    step: int,
    options: SaveOptions,
    wire: Any = _collectives,
) -> tuple[SavePlan, dict[str, Any], int]:
    """Agree on and plan the save of ``step``; collective over ``group``.

    ``meta``: this rank's ``error`` (or None), JSON ``values`` and, on rank 0, ``attempt`` and
    ``replaces`` (elsewhere absent); the rows of the tensors to coordinate come from ``leaves``.
    Returns the plan, this rank's values (reported at the commit; the caller's copy, which
    nothing changes any more) and the number of ranks. Raises the same error on every rank when a rank failed, the ranks save different
    steps, or the ranges do not fit together.
    ``wire``: the collectives (``rank_world``, ``all_reduce_max``, ``all_gather_json``,
    ``broadcast_json``, ``gather_json``, ``scatter_json`` of storage/io/_collectives.py), replaced
    only by the scale simulation (``ftsdp.tools.dev.simulation``).
    """
    rank, world = wire.rank_world(group)
    error = meta.get("error")
    values = meta.get("values", {}) if error is None else {}
    table, names, rules, ruled = local_rules(leaves, rank, world) if error is None else NO_RULES
    # Ranks whose options pack objects differently would derive other ranks' objects unlike
    # those written (a committed step no reader could derive): such tables never agree.
    names ^= hash((options.object_bytes, options.replica_split_bytes)) & (2**63 - 1)
    block = options.checksum_block_bytes
    attempt, replaces = meta.get("attempt"), meta.get("replaces")
    code = attempt_code(attempt)
    say = 1 if replaces is not None or (attempt is not None and not code) else 0
    top = wire.all_reduce_max(
        [1 if error else 0, step, -step, names, -names, block, -block, ruled, -ruled, code, say],
        group,
    )
    if top[0] or top[1] != -top[2]:
        check_exchange(wire.all_gather_json({"error": error, "step": step}, group), step)
    if top[5] != -top[6]:  # the manifest has one block size: other ranks' checksums would not fit
        raise CheckpointError(
            f"save of step {step}: the ranks checksum blocks of {-top[6]} to {top[5]} bytes "
            "(SaveOptions.checksum_block_bytes); pass the same SaveOptions on every rank"
        )
    if top[10]:  # rank 0's ids do not travel as numbers
        head = wire.broadcast_json(
            {"attempt": attempt, "replaces": replaces} if rank == 0 else None, group
        )
        attempt, replaces = head["attempt"], head["replaces"]
    else:
        attempt, replaces = attempt_of_code(top[9]), None
    assert attempt is not None  # rank 0 made one (fresh_attempt), or the save failed above
    agreed = top[3] == -top[4]  # the same tensors everywhere: then compare their rules
    if agreed and world > 1 and top[7] != -top[8]:  # (equal digests: every rule is the same)
        both = wire.all_reduce_max([*rules, *(-v for v in rules)], group)
        n = len(rules)
        same = [both[i] == -both[n + i] for i in range(n)]
        table = keep_agreed(table, [all(same[3 * i : 3 * i + 3]) for i in range(len(table))])
    regular, mine = regular_share(table, world, options, rank, attempt) if agreed else (None, [])
    irregular = {row[0] for row in table if row[3] == _IRREGULAR} if agreed else set(leaves)
    # The same on every rank (``irregular`` is not, when the tables differ: a rank may hold
    # none of the tensors, and once skipped the gather and scatter its peers waited in).
    coordinate = bool(irregular) if agreed else True
    listed: list[PlannedObject] = []
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    if coordinate:
        send = {"tensors": tensor_rows(leaves, irregular), "first": len(mine)}
        gathered = wire.gather_json(send, group)
        shares: list[Any] | None = None
        if rank == 0 and gathered is not None:
            listed, shapes, shares = _coordinate(gathered, attempt, options, world)
        share = wire.scatter_json(shares, group)
        if isinstance(share, dict):
            raise ValueError(share["error"])
        if rank != 0:
            listed = _objects(rank, len(mine), attempt, share, leaves)
        mine = mine + [o for o in listed if o.rank == rank]
    plan = SavePlan(attempt, shapes, listed, regular, mine, replaces)
    return plan, values, world


_ATTEMPT_DIGITS = 14  # hex digits an attempt id may have to travel in the all-reduce


def attempt_code(attempt: str | None) -> int:
    """An attempt id as one positive int64 (its length, then its digits), 0 for none or for an
    id that does not fit (more than 14 hex digits, or not lowercase hex): that one is
    broadcast instead."""
    if (
        attempt is None
        or not 0 < len(attempt) <= _ATTEMPT_DIGITS
        or attempt.strip("0123456789abcdef")
    ):
        return 0
    return len(attempt) << (4 * _ATTEMPT_DIGITS) | int(attempt, 16)


def attempt_of_code(code: int) -> str | None:
    """The attempt id ``attempt_code`` made ``code`` of (None for 0)."""
    if not code:
        return None
    digits = code >> (4 * _ATTEMPT_DIGITS)
    return f"{code & ((1 << (4 * _ATTEMPT_DIGITS)) - 1):0{digits}x}"


_KINDS = {"irregular": 0, "whole": 1, "even": 2}


def tensor_rows(leaves: dict[str, TensorLeaf], names: Collection[str]) -> list[list[Any]]:
    """``[name, shape, dtype, offset, length]`` of the leaves named in ``names``, by name: what
    the coordinator plans from (built only for the tensors it coordinates)."""
    return [
        [n, list(t.shape), dtype_name(t.dtype), t.range.offset, t.range.length]
        for n, t in sorted(leaves.items())
        if n in names
    ]


NO_RULES: tuple[list[list[Any]], int, list[int], int] = ([], 0, [], 0)


def local_rules(
    leaves: dict[str, TensorLeaf], rank: int, world: int
) -> tuple[list[list[Any]], int, list[int], int]:
    """What a rank computes before the exchange: its rule table, the digest of its tensors'
    names, shapes and dtypes, each rule as three integers (kind, start, chunk), compared
    exactly by the exchange, and a digest of those integers (when every rank's is the same,
    so are the rules, and that comparison is skipped). Kept for the last few states: a
    training job saves the same ranges at every step."""
    key = (
        rank,
        world,
        tuple(
            (n, leaf.shape, leaf.dtype, leaf.range.offset, leaf.range.length, leaf.layout)
            for n, leaf in sorted(leaves.items())
        ),
    )
    hit = _tables.get(key)
    if hit is not None:
        return hit
    table = rule_table(leaves, rank, world)
    names = table_digest([row[:3] for row in table], world)
    ints = []
    for row in table:
        rule = row[3]
        ints += [_KINDS[rule[0]], *(rule[1:] if rule[0] == "even" else (0, 0))]
    ruled = hashlib.blake2b(array.array("q", ints).tobytes(), digest_size=8).digest()
    made = (table, names, ints, int.from_bytes(ruled, "little") >> 1)
    _tables.put(key, made)
    return made


def keep_agreed(table: list[list[Any]], agreed: list[bool]) -> list[list[Any]]:
    """``table`` with the rules not every rank agreed on (``agreed[i]`` false) made irregular
    (``table`` itself when every rule is agreed)."""
    if all(agreed):
        return table
    key = (id(table), tuple(agreed))
    hit = _agreed.get(key)
    if hit is not None and hit[0] is table:
        return hit[1]
    made = [row if ok else [*row[:3], _IRREGULAR] for row, ok in zip(table, agreed, strict=True)]
    _agreed.put(key, (table, made))
    return made


def regular_share(
    table: list[list[Any]], world: int, options: SaveOptions, rank: int, attempt: str
) -> tuple[RegularLayout | None, list[PlannedObject]]:
    """The layout of an agreed table (None when no tensor has a rule) and ``rank``'s regular
    objects, from the table alone (kept between saves of the same table)."""
    regular = _layout(table, world, options)
    if not regular.entries:
        return None, []
    return regular, regular.rank_objects(rank, attempt)


def check_exchange(metas: list[dict[str, Any]], step: int) -> None:
    """Raise, on every rank alike, when a rank failed to describe its state or the ranks are not
    saving the same step (a loop that went on after a save failed on some ranks only: every
    later exchange would pair different saves)."""
    for r, m in enumerate(metas):
        if m["error"]:
            raise CheckpointError(f"save of step {step} failed on rank {r}: {m['error']}")
    steps = [m.get("step") for m in metas]
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"the ranks are not saving the same step (steps by rank: {steps}): a save failed on "
            "some ranks only and the loop went on; restart the job from its last checkpoint"
        )


def _coordinate(
    gathered: list[dict[str, Any]], attempt: str, options: SaveOptions, world: int
) -> tuple[list[PlannedObject], dict[str, tuple[tuple[int, ...], str]], list[Any]]:
    """Rank 0: the plan of the irregular tensors (numbered after each rank's regular objects)
    and each rank's share of it, or the same error for every rank."""
    try:
        plan = make_plan([{"tensors": g["tensors"]} for g in gathered], attempt, options)
    except ValueError as e:
        return [], {}, [{"error": str(e)}] * world
    first = {r: g["first"] for r, g in enumerate(gathered)}
    listed = renamed(plan.objects, attempt, first)
    shares: list[list[Any]] = [[] for _ in range(world)]
    for o in listed:
        shares[o.rank].append([[p.name, p.offset, p.length] for p in o.pieces])
    return listed, plan.shapes, shares


def _objects(
    rank: int, first: int, attempt: str, share: list[Any], leaves: dict[str, TensorLeaf]
) -> list[PlannedObject]:
    """This rank's listed objects from its share of the coordinator's plan."""
    out = []
    for i, pieces in enumerate(share):
        obj = PlannedObject(
            object_name(rank, first + i, attempt),
            rank,
            [PlannedPiece(n, o, ln, leaves[n].dtype) for n, o, ln in pieces],
        )
        obj.head, obj.byte_ranges, obj.size = safetensors_layout(
            [(p.key, p.dtype, p.length) for p in obj.pieces]
        )
        out.append(obj)
    return out


# The layouts of the last tables: a training job saves the same table at every step, and a rank's
# objects are kept in its layout (RegularLayout.rank_objects).
_layouts: Kept[tuple[Any, ...], tuple[list[list[Any]], RegularLayout]] = Kept(8)
_tables: Kept[tuple[Any, ...], tuple[list[list[Any]], int, list[int], int]] = Kept(8)
_agreed: Kept[tuple[Any, ...], tuple[list[list[Any]], list[list[Any]]]] = Kept(8)


def _layout(table: list[list[Any]], world: int, options: SaveOptions) -> RegularLayout:
    key = (id(table), world, options.object_bytes, options.replica_split_bytes)
    hit = _layouts.get(key)
    if hit is not None and hit[0] is table:  # the very table kept by local_rules
        return hit[1]
    made = resolve(table, world, options.object_bytes, options.replica_split_bytes)
    _layouts.put(key, (table, made))  # holds the table: its id stays unique while kept
    return made
