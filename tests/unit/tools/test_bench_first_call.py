"""The first-call benchmark (``python -m ftsdp.tools.bench_first_call``) at a tiny size: every
row is measured for both libraries, and every load (the one-process load for inference too) is
checked against the values saved.

The ranks run in this process (one rank, a process group of one): the spawned 2 -> 3 run is the
benchmark's own, its resharding covered by tests/distributed."""

from __future__ import annotations

import importlib
import json
import pathlib
from typing import Any

import pytest
import torch.distributed as dist

from ftsdp.tools import bench_first_call


def _in_process(fn: str, world: int, *args: Any, **_: Any) -> list[Any]:
    """``run_ranks`` for one rank: a gloo group of one in this process around ``fn``."""
    assert world == 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        module, _, name = fn.partition(":")
        return [getattr(importlib.import_module(module), name)(0, 1, *args)]
    finally:
        dist.destroy_process_group()


def test_every_row_is_measured_and_every_load_holds_the_saved_values(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setattr(bench_first_call, "run_ranks", _in_process)
    checked: list[int] = []
    check = bench_first_call._check

    def counting(state: dict) -> int:
        checked.append(check(state))
        return checked[-1]

    monkeypatch.setattr(bench_first_call, "_check", counting)
    out, results = tmp_path / "bench.md", tmp_path / "bench.json"
    args = ["--size-mb", "0.5", "--dim", "32", "--world", "1", "--load-world", "1"]
    args += ["--rounds", "1", "--dir", str(tmp_path), "--out", str(out), "--json", str(results)]
    rows = bench_first_call.main(args)

    assert set(rows) == {key for key, _, _ in bench_first_call.ROWS}
    for key, row in rows.items():
        for lib in bench_first_call.LIBS:
            assert row[lib]["min"] <= row[lib]["median"] <= row[lib]["max"], key
            assert row[lib]["min"] > 0 or key == "async_cpu_s", (key, lib)
        assert len(row["ratios"]) == 1
    # both libraries loaded every tensor of the state, each equal to what was saved: per
    # parameter (6 a block) the parameter, AdamW's two moments and its step
    blocks = bench_first_call.blocks_for({"size_mb": 0.5, "dim": 32})
    assert checked == [4 * 6 * blocks] * 2
    text = out.read_text()
    assert text.startswith("# Benchmarks") and "## First call" in text
    assert "| sync save GB/s |" in text and "| load 1 -> 1 GB/s |" in text
    assert "| one-process load of everything (inference) GB/s |" in text
    entry = json.loads(results.read_text())["first_call"]
    assert len(entry["rounds"]) == 1 and entry["bytes"] > 0
    # the one-process loads (no model built) checked every tensor against its saved values too
    for lib in bench_first_call.LIBS:
        assert entry["rounds"][0][lib]["infer_checked"] == 4 * 6 * blocks, lib


def test_a_load_that_differs_from_the_save_is_caught() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = {"size_mb": 0.1, "dim": 16}
        _, _, saved = bench_first_call._model_and_state(1, cfg, fill=True)
        assert bench_first_call._check(saved) > 0
        _, _, fresh = bench_first_call._model_and_state(1, cfg, fill=False)
        with pytest.raises(AssertionError, match="differ from the saved ones"):
            bench_first_call._check(fresh)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lib", bench_first_call.LIBS)
def test_a_one_process_load_that_differs_from_the_save_is_caught(
    lib: str, tmp_path: pathlib.Path
) -> None:
    import torch.distributed.checkpoint as dcp

    from ftsdp import storage

    cfg = {"size_mb": 0.1, "dim": 16, "root": str(tmp_path), "cold": False}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _, _, unfilled = bench_first_call._model_and_state(1, cfg, fill=False)
        names = [name for name, _ in bench_first_call._leaves(unfilled)]
        path = str(tmp_path / f"{lib}-sync")  # where infer_rank reads lib's sync save
        if lib == "dcp":
            dcp.save(unfilled, checkpoint_id=path)
        else:
            storage.save(unfilled, path, 1)
        with pytest.raises(AssertionError, match="differ from the saved ones"):
            bench_first_call.infer_rank(0, 1, cfg, lib, names)
    finally:
        dist.destroy_process_group()
