"""The scale simulation (issue: thousands of ranks): the real planning, manifest and read-planning
code for synthetic ranks. What grows with the world size is checked by counts, not timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ftsdp.storage import SaveOptions
from ftsdp.storage.format._manifest import Manifest
from ftsdp.storage.saving._save_plan import make_plan
from ftsdp.tools.dev import simulate_scale
from ftsdp.tools.dev.simulation import (
    commit_manifest,
    leaves,
    load_planning,
    markers,
    plan_rank,
    shapes,
)

T = 60


@pytest.mark.parametrize("layout", ["flat", "shard0"])
def test_every_rank_plans_its_share_of_a_regular_layout_alone(layout: str) -> None:
    """Each rank's objects, planned from the rule table alone, are exactly what the old
    protocol (every rank's ranges gathered, one plan) gives that rank to write, element for
    element; and the ranks together write every element once."""
    options, world = SaveOptions(), 16
    metas = []
    for r in range(world):
        held = leaves(layout, world, r, T)
        rows = [
            [n, list(t.shape), "float32", t.range.offset, t.range.length]
            for n, t in sorted(held.items())
        ]
        metas.append({"tensors": rows})
    old = make_plan(metas, "a", options)
    written: dict[str, int] = {}
    for r in range(world):
        plan, nbytes = plan_rank(leaves(layout, world, r, T), world, r, options)
        regular, mine = plan.regular, plan.own(r)
        assert regular is not None and len(regular.entries) == T
        assert nbytes < 100 * T + (2000 if r else 60 * world)  # rank 0 also gathers values
        new = sorted((p.name, p.offset, p.length) for o in mine for p in o.pieces)
        had = sorted((p.name, p.offset, p.length) for o in old.for_rank(r) for p in o.pieces)
        assert new == had, r
        for name, _, length in new:
            written[name] = written.get(name, 0) + length
    assert written == {n: math.prod(s) for n, s in shapes(T).items()}


@pytest.mark.parametrize("layout", ["flat", "shard0"])
def test_the_manifest_grows_with_ranks_not_with_ranks_times_tensors(layout: str) -> None:
    options = SaveOptions()
    sizes = {}
    for world in (8, 64):
        data = commit_manifest(markers(layout, world, T, options), world, options).to_json()
        decoded = Manifest.from_json(data, where="sim")
        assert all(t.rule is not None for t in decoded.tensors.values())
        assert "pieces" not in json.loads(data)["tensors"]["u0000.t0"]
        sizes[world] = len(data)
        # a rank of half the world plans its reads from the pieces of the ranks it touches only
        load_planning(decoded, layout, world // 2, world // 2 - 1, T)
        derived = decoded.regular._ranks  # type: ignore[union-attr]
        assert 0 < len(derived) <= 4, sorted(derived)
    per_rank = (sizes[64] - sizes[8]) / 56
    assert per_rank < 12 * T, per_rank  # ~5.3 bytes per piece (a base64 checksum), not ~700


def test_the_tool_prints_its_table_and_verdicts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out, js = tmp_path / "b.md", tmp_path / "b.json"
    simulate_scale.main(
        [
            "--worlds",
            "8",
            "32",
            "--tensors",
            "24",
            "--old-max-world",
            "32",
            "--sample",
            "2",
            "--out",
            str(out),
            "--json",
            str(js),
        ]
    )
    text = capsys.readouterr().out
    assert text.count("| flat |") == 2 and text.count("| shard0 |") == 2
    assert "heartbeat store operations per interval <= 4 W" in text
    assert out.read_text().startswith("# Benchmarks") and "## Scale (simulated)" in out.read_text()
    rows = json.loads(js.read_text())["scale"]["rows"]
    assert {r["world"] for r in rows} == {8, 32}
    # the same bytes exchanged per rank at W=8 and W=32; the old all-gather grew with W
    by = {(r["layout"], r["world"]): r for r in rows}
    assert by["shard0", 8]["exchanged"] == by["shard0", 32]["exchanged"]
    assert by["shard0", 32]["old_exchanged"] > 3 * by["shard0", 8]["old_exchanged"]


def test_a_failing_rank_raises_through_the_stand_in_collectives() -> None:
    """The simulation's collectives answer the error path too: a rank that failed to describe
    its state raises the same CheckpointError as on a real group."""
    from ftsdp import storage
    from ftsdp.storage.saving import _exchange
    from ftsdp.tools.dev.simulation import Wire

    meta = {"error": "ValueError: bad leaf", "values": {}, "tensors": []}
    with pytest.raises(storage.CheckpointError, match="failed on rank 0: ValueError: bad leaf"):
        _exchange.exchange({}, meta, None, 3, SaveOptions(), Wire(0, 8))
