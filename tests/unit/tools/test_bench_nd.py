"""The N-D benchmark (``python -m ftsdp.tools.bench_nd``) at a tiny size: a real 1x2 save
spawn (FSDP2 + TP, W=2; the default 2x2 costs two more ranks on the suite's two cores) and one
reshard load spawn (dp=2, FSDP2 alone), every row measured for both
engines, both loads checked bitwise against each other and against the saved sums; and the
checks themselves catch a load that differs, one left at zero, and wrong sums."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch.distributed as dist

from ftsdp.tools import bench_nd


@pytest.mark.timeout(420)
def test_a_tiny_run_measures_every_row_and_loads_bitwise(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, results = tmp_path / "bench.md", tmp_path / "bench.json"
    # 0.2 MB at width 32: 2 blocks (48 tensors with AdamW's), every placement of the layout
    args = ["--size-mb", "0.2", "--dim", "32", "--save-mesh", "1x2", "--loads", "2x1"]
    args += ["--rounds", "1", "--warmup", "0"]
    summary = bench_nd.main(
        [*args, "--dir", str(tmp_path), "--out", str(out), "--json", str(results)]
    )

    assert set(summary) == {"save", "async_blocking", "async_total", "load 2x1", "warm 2x1"}
    for key, row in summary.items():
        for engine in bench_nd.ENGINES:
            assert row[engine]["median"] > 0, (key, engine)
        assert len(row["ratios"]) == 1
    text = out.read_text()
    assert text.startswith("# Benchmarks") and bench_nd.TITLE in text
    for label in (
        "| save at 1x2, GB/s |",
        "| async save at 1x2: blocking s |",
        "| load 1x2 -> 2x1, cache dropped, GB/s |",
        "| load 1x2 -> 2x1, warm cache, GB/s |",
        "| bytes read / needed, 1x2 -> 2x1 |",
        "| raw floor: the same bytes written with plain file writes, GB/s |",
        "| raw floor: ftsdp's files read at W=2, cache dropped, GB/s |",
    ):
        assert label in text, label
    assert "python -m ftsdp.tools.bench_nd --size-mb 0.2" in text
    assert text == "# Benchmarks\n\n" + capsys.readouterr().out.split("\nwrote")[0]
    entry = json.loads(results.read_text())["nd"]
    # the load spawn compared every tensor of the state (parameters, AdamW's moments, steps)
    assert entry["checked"] == {"2x1": entry["tensors"]} and entry["tensors"] > 10
    assert entry["load_times"]["2x1"]["ftsdp.read_ratio"][0] >= 1.0
    assert list(tmp_path.glob("bench-nd-*")) == []  # the checkpoints are removed


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_checks_catch_a_differing_a_zero_and_a_wrong_load(one_rank: None) -> None:
    cfg = {"size_mb": 0.1, "dim": 16}
    mine, theirs = bench_nd.build(1, 1, cfg), bench_nd.build(1, 1, cfg)
    names = list(bench_nd.tensors(mine))
    assert bench_nd.compare(mine, theirs) == len(names) > 0
    saved = bench_nd.sums(mine)
    bench_nd.check_sums(theirs, saved)

    weight = bench_nd.tensors(theirs)["model.0.up.weight"].to_local()
    kept = weight.clone()
    weight.view(-1)[3] += 1.0
    with pytest.raises(AssertionError, match=r"different values into \['model.0.up.weight'\]"):
        bench_nd.compare(mine, theirs)
    with pytest.raises(AssertionError, match="model.0.up.weight"):
        bench_nd.check_sums(theirs, saved)

    for state in (mine, theirs):
        bench_nd.tensors(state)["model.0.down.bias"].to_local().zero_()
    weight.copy_(kept)
    with pytest.raises(AssertionError, match=r"left all zero: \['model.0.down.bias'\]"):
        bench_nd.compare(mine, theirs)
