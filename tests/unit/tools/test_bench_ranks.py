"""A smoke run of ``tools/_bench_ranks.py`` (the runner behind the Checkpoint table of
docs/benchmarks.md) at a tiny size: one spawn of 2 ranks runs its save phase and then its load
phase (2 -> 2), local ``storage`` and DCP. The rows ``bench_checkpoint`` builds from them must be
sane: the bytes its rates divide are the state's size as DCP's own metadata records it, times and
rates are positive, reads cover what is needed; and the saved checkpoints hold the values the
runner generates, recomputed here from its formula and read back by torch's ``dcp.load`` and by
``storage``. (The load phase itself raises unless every loaded shard holds those values.)
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.testing import run_ranks
from ftsdp.tools import _bench_ranks as ranks
from ftsdp.tools import bench_checkpoint

WORLD, REPEATS = 2, 2


def _save_then_load(rank: int, world: int, cfg: dict[str, Any]) -> tuple[dict, dict]:
    return ranks.save_phase(rank, world, cfg), ranks.load_phase(rank, world, cfg)


def _pattern(seed: int, numel: int) -> torch.Tensor:
    """The runner's values of a tensor, from its documented formula (not its code)."""
    idx = torch.arange(numel, dtype=torch.int64)
    return ((idx * 40503 + seed * 977) % 65521).to(torch.float32)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bench-ranks")
    shape_map = ranks.shapes(50_000, 16)  # the embedding and one layer: 1-D and 2-D shards
    cfg = {
        "shapes": shape_map,
        "bytes": ranks.state_bytes(shape_map),
        "root": str(root),
        "repeats": REPEATS,
        "backends": ["storage", "dcp"],
        "s3": None,
    }
    save, load = run_ranks(_save_then_load, WORLD, cfg, timeout=120)[0]
    return {"cfg": cfg, "root": root, "res": {"bytes": cfg["bytes"], "save": save, "load2": load}}


@pytest.mark.timeout(150)
def test_the_rows_are_sane(run: dict[str, Any]) -> None:
    args = bench_checkpoint.parse(
        ["--ranks", "2", "--load-ranks", "2", "--backends", "storage,dcp", "--repeats", "2"]
    )
    rows, verdicts, raw_w, raw_r = bench_checkpoint.measurements(args, run["res"])
    assert raw_w > 0 and raw_r > 0
    names = [row[0] for row in rows]
    assert names[:3] == ["save GB/s", "load 2 -> 2 GB/s", "load 2 -> 2 GB/s, warm cache"], names
    for name, st, dc, s3, _, _ in rows:
        assert s3 is None, name  # no S3 backend in this run
        if name.startswith("storage.saving.prepare_save"):
            assert st > 0 and dc is None, name
            continue
        assert st is not None and dc is not None, name
        assert 0 < st < math.inf and 0 < dc < math.inf, (name, st, dc)
        if name.startswith("bytes read / needed"):
            assert st >= 1.0 and dc >= 1.0, (name, st, dc)  # nothing needed is left unread
    for key, values in run["res"]["save"].items():
        assert len(values) == (1 if key == "storage.prepare_s" else REPEATS), key
        assert all(v > 0 for v in values), (key, values)
    assert all(v.startswith("- ") and ("MET" in v or "MISSED" in v) for v in verdicts), verdicts
    text, _ = bench_checkpoint.table(args, run["res"])
    assert all(name in text for name in names)


@pytest.mark.timeout(150)
def test_bytes_are_the_states_size_and_the_checkpoints_hold_its_values(
    run: dict[str, Any],
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shape_map, nbytes = run["cfg"]["shapes"], run["res"]["bytes"]
    dcp_dir = str(run["root"] / "dcp" / f"save-{REPEATS - 1}")
    metadata = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    tensors = {k: m for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
    saved = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors.values())
    assert saved == nbytes  # DCP's record of what it saved is the size the rates divide
    info = storage.catalog.inspect_checkpoint(str(run["root"] / "storage"))
    assert info["total_bytes"] == nbytes and info["step"] == 100 + REPEATS - 1

    expected: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(shape_map.items()):
        n = math.prod(shape)
        expected[f"model.{name}"] = _pattern(3 * i, n).view(shape)
        expected[f"optim.state.{name}.exp_avg"] = _pattern(3 * i + 1, n).view(shape)
        expected[f"optim.state.{name}.exp_avg_sq"] = _pattern(3 * i + 2, n).view(shape)
        expected[f"optim.state.{name}.step"] = torch.tensor(7.0)
    assert sorted(tensors) == sorted(expected)
    target = {k: torch.zeros_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(target, checkpoint_id=dcp_dir, no_dist=True)
    got = storage.load_state_dict(str(run["root"] / "storage"))
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(target[k], v), k
        assert torch.equal(got[k], v), k


def test_the_s3_table_gives_medians_spreads_and_per_round_ratios() -> None:
    args = bench_checkpoint.parse(["--ranks", "2"])
    res = {
        "bytes": 10**9,
        "s3save": {
            "raw.save_gbps": [1.0, 2.0, 4.0],
            "storage.save_gbps": [1.0, 1.0, 4.0],
            "dcp.save_gbps": [0.5, 0.5, 1.0],
        },
        "s3load3": {
            "raw.load_gbps": [2.0, 2.0, 2.0],
            "storage.load_gbps": [1.0, 2.0, 3.0],
            "dcp.load_gbps": [1.0, 1.0, 1.0],
            "storage.read_ratio": [1.1],
        },
    }
    text, verdicts, rows = bench_checkpoint.s3_table(args, res)
    lines = text.splitlines()
    # storage / raw per round: 1.0, 0.5, 1.0 -> median 1.00x, spread 0.50-1.00
    assert "| save, W=2 | 2.000 (1.000-4.000) | 1.000 (1.000-4.000) |" in lines[2]
    assert "| 1.00x (0.50-1.00) | 2.00x (2.00-4.00) | >= 0.9x raw |" in lines[2]
    assert lines[3].startswith("| load 2 -> 3 | 2.000 (2.000-2.000) | 2.000 (1.000-3.000) |")
    assert "| 1.00x (0.50-1.50) | 2.00x (1.00-3.00) |" in lines[3]
    assert "| bytes read / needed, load 2 -> 3 | | 1.100 |" in lines[4]
    assert verdicts == [
        "- S3 save, W=2 >= 0.9x raw: MET (1.00x, median of the rounds' ratios)",
        "- S3 load 2 -> 3 >= 0.9x raw: MET (1.00x, median of the rounds' ratios)",
        "- S3 load 2 -> 3 >= 1.5x DCP: MET (2.00x)",
    ]
    assert [r["measurement"] for r in rows] == ["S3 save, W=2", "S3 load 2 -> 3"]
