"""Range arithmetic, the save plan (dedupe, coverage, packing) and the read plan (coalescing)."""

from __future__ import annotations

import pytest

from ftsdp.storage import SaveOptions
from ftsdp.storage.format._manifest import Piece, TensorEntry
from ftsdp.storage.format._ranges import Range, check_disjoint_cover, coalesce, intersect, segments
from ftsdp.storage.loading._read_plan import make_want, plan_reads
from ftsdp.storage.saving._save_plan import make_plan


def test_range_arithmetic() -> None:
    assert intersect(Range(0, 10), Range(5, 10)) == Range(5, 5)
    assert intersect(Range(0, 5), Range(5, 10)) is None
    assert segments([Range(0, 10), Range(5, 10), Range(20, 5)]) == [
        Range(0, 5),
        Range(5, 5),
        Range(10, 5),
        Range(20, 5),
    ]
    assert coalesce([(10, 20), (0, 10), (25, 30)]) == [(0, 20), (25, 30)]
    assert coalesce([(10, 20), (0, 8), (25, 30)], gap=5) == [(0, 30)]
    check_disjoint_cover([Range(0, 4), Range(4, 6)], 10, "t")
    with pytest.raises(ValueError, match="overlap at element 3"):
        check_disjoint_cover([Range(0, 4), Range(3, 7)], 10, "t")
    with pytest.raises(ValueError, match=r"\[4, 5\) are not covered"):
        check_disjoint_cover([Range(0, 4), Range(5, 5)], 10, "t")
    with pytest.raises(ValueError, match="outside"):
        check_disjoint_cover([Range(-1, 11)], 10, "t")


def _meta(*tensors: tuple) -> dict:
    return {"tensors": [list(t) for t in tensors], "values": {}}


def test_plan_shards_each_rank_writes_its_own() -> None:
    metas = [_meta(("w", [4, 5], "float32", 0, 12)), _meta(("w", [4, 5], "float32", 12, 8))]
    plan = make_plan(metas, "abcd1234", SaveOptions())
    (o0,), (o1,) = plan.for_rank(0), plan.for_rank(1)
    assert [(p.name, p.offset, p.length) for p in o0.pieces] == [("w", 0, 12)]
    assert [(p.name, p.offset, p.length) for p in o1.pieces] == [("w", 12, 8)]
    assert o0.name == "rank00000-000-abcd1234.safetensors"
    # Byte ranges follow the safetensors header and the size is exact.
    start, end = o0.byte_ranges[0]
    assert end - start == 48 and o0.size == end


def test_plan_dedupes_replicas_and_spreads_them() -> None:
    # Three ranks replicate 6 small tensors: each written once, 2 per rank.
    tensors = [(f"t{i}", [10], "float32", 0, 10) for i in range(6)]
    metas = [_meta(*tensors) for _ in range(3)]
    plan = make_plan(metas, "a", SaveOptions())
    counts = [sum(len(o.pieces) for o in plan.for_rank(r)) for r in range(3)]
    assert counts == [2, 2, 2]
    written = sorted(p.name for o in plan.objects for p in o.pieces)
    assert written == [f"t{i}" for i in range(6)]
    # A big replicated tensor is split among its holders.
    metas = [_meta(("big", [1000], "float32", 0, 1000)) for _ in range(4)]
    plan = make_plan(metas, "a", SaveOptions(replica_split_bytes=1024))
    parts = sorted((p.offset, p.length, o.rank) for o in plan.objects for p in o.pieces)
    assert parts == [(0, 250, 0), (250, 250, 1), (500, 250, 2), (750, 250, 3)]


def test_plan_partial_overlap_and_determinism() -> None:
    metas = [
        _meta(("w", [100], "int64", 0, 60)),
        _meta(("w", [100], "int64", 40, 60)),  # overlaps rank 0 on [40, 60)
    ]
    a, b = make_plan(metas, "x", SaveOptions()), make_plan(metas, "x", SaveOptions())
    pieces = sorted((p.offset, p.length) for o in a.objects for p in o.pieces)
    covered = [Range(*p) for p in pieces]
    check_disjoint_cover(covered, 100, "w")  # every element exactly once
    assert [(o.name, o.pieces) for o in a.objects] == [(o.name, o.pieces) for o in b.objects]


def test_plan_rejects_inconsistent_metadata() -> None:
    with pytest.raises(ValueError, match=r"'w'.*rank 1 has shape"):
        make_plan(
            [_meta(("w", [4], "float32", 0, 4)), _meta(("w", [5], "float32", 0, 5))],
            "a",
            SaveOptions(),
        )
    with pytest.raises(
        ValueError, match=r"'w'.*elements \[6, 10\) are not covered \(held by no rank\)"
    ):
        make_plan(
            [_meta(("w", [10], "float32", 0, 3)), _meta(("w", [10], "float32", 3, 3))],
            "a",
            SaveOptions(),
        )
    with pytest.raises(ValueError, match="outside"):
        make_plan([_meta(("w", [10], "float32", 8, 5))], "a", SaveOptions())


def test_plan_packs_objects_within_size() -> None:
    metas = [_meta(("a", [1000], "float32", 0, 1000), ("b", [10], "float64", 0, 10))]
    plan = make_plan(metas, "a", SaveOptions(object_bytes=1600))
    payloads = [o.payload_bytes for o in plan.objects]
    assert all(p <= 1600 for p in payloads) and sum(payloads) == 4000 + 80
    a = sorted((p.offset, p.length) for o in plan.objects for p in o.pieces if p.name == "a")
    check_disjoint_cover([Range(*x) for x in a], 1000, "a")


def _entry(pieces: list[tuple[str, int, int, int]], numel: int, block: int) -> TensorEntry:
    out = []
    for obj, offset, length, byte_start in pieces:
        nblocks = -(-length * 4 // block)
        out.append(
            Piece(obj, "k", offset, length, byte_start, byte_start + length * 4, (0,) * nblocks)
        )
    return TensorEntry((numel,), "float32", tuple(out))


def test_read_plan_intersects_aligns_and_coalesces() -> None:
    # Two adjacent pieces in one object, one in another.
    entry = _entry([("o1", 0, 100, 64), ("o1", 100, 100, 464), ("o2", 200, 50, 8)], 250, 64)
    want = make_want("t", entry, Range(90, 130))  # elements 90..220
    spans = plan_reads([want], block=64)
    # o2: elements 200..220 are bytes [0, 80) of the piece, widened to the 128-byte block end.
    assert [(s.object, s.start, s.end) for s in spans] == [("o1", 384, 864), ("o2", 8, 136)]
    o1 = spans[0]
    # Widened to whole 64-byte blocks: the last two blocks of piece 1 and all of piece 2.
    assert sorted((p.offset, k) for _, p, k in o1.blocks.values()) == [
        (0, 5),
        (0, 6),
        *[(100, k) for k in range(7)],
    ]
    assert [(c.src, c.nbytes, c.dst_byte) for c in o1.copies] == [(424, 40, 0), (464, 400, 40)]
    # Blocks 0 and 5 of piece 1 are apart: two reads, or one when a gap that large is allowed.
    a, b = Range(0, 16), Range(80, 10)
    assert len(plan_reads([make_want("t", entry, a), make_want("t", entry, b)], 64)) == 2
    merged = plan_reads([make_want("t", entry, a), make_want("t", entry, b)], 64, gap=256)
    assert [(s.start, s.end) for s in merged] == [(64, 448)]
