"""A restart of the main job with another ``--lr``, ``--min-lr``, ``--warmup`` or
``--weight-decay`` trains with them (lowering the learning rate after a loss spike is a common
reason to restart): the resumed optimizer held the checkpoint's values, and the new checkpoint's
config named values the run never used. The same flags leave the resumed run bitwise."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from ftsdp import storage
from ftsdp.train import main
from ftsdp.trainer._job import lr_at

pytestmark = pytest.mark.timeout(180)

TINY = [
    *["--vocab-size", "16", "--block-size", "8", "--n-layer", "1", "--n-head", "1"],
    *["--n-embd", "8", "--global-batch", "2", "--micro-batch", "2"],
    *["--log-every", "1", "--device", "cpu", "--heartbeat-timeout-s", "0"],
    *["--checkpoint-every", "2", "--keep-last", "10"],
]


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTSDP_FAULT"):
        monkeypatch.delenv(key, raising=False)


def _steps(path: pathlib.Path) -> dict[int, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r for r in records if r["event"] == "step"}


def _groups(url: str, step: int) -> list[dict]:
    with storage.LazyStateDict(url, step) as ckpt:
        return json.loads(ckpt.values["optim.param_groups"])


def test_a_restart_with_other_schedule_flags_trains_with_them(tmp_path: pathlib.Path) -> None:
    url, metrics = str(tmp_path / "ck"), tmp_path / "metrics.jsonl"
    first = [*TINY, "--checkpoint-url", url, "--metrics", str(metrics)]
    assert main([*first, "--steps", "4", "--lr", "1e-2", "--weight-decay", "0.1"]) == 0
    again = ["--steps", "6", "--lr", "1e-4", "--min-lr", "1e-5", "--warmup", "0"]
    assert main([*first, *again, "--weight-decay", "0.0"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (changed,) = [r for r in records if r["event"] == "flags_changed"]
    assert changed["step"] == 4 and len(changed["changed"]) == 4, changed
    new = [*TINY, *again, "--weight-decay", "0.0"]
    from ftsdp.trainer._config import parse_args

    cfg = parse_args(new)
    steps = _steps(metrics)
    for step in (5, 6):  # the step's record: the learning rate its optimizer step used
        assert steps[step]["lr"] == pytest.approx(lr_at(step - 1, cfg), rel=1e-12), step
    groups = _groups(url, 6)
    assert groups[0]["weight_decay"] == 0.0 and groups[1]["weight_decay"] == 0.0
    assert groups[0]["initial_lr"] == 1e-4
    with storage.LazyStateDict(url, 6) as ckpt:
        assert json.loads(ckpt.values["trainer.config"])["lr"] == 1e-4


def test_a_restart_with_the_same_flags_is_bitwise_the_uninterrupted_run(
    tmp_path: pathlib.Path,
) -> None:
    """Step 6 of a whole run, against the same run resumed from its step 4 (step 6 removed)."""
    flags = [*TINY, "--lr", "3e-3", "--warmup", "2", "--weight-decay", "0.05", "--steps", "6"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*flags, "--checkpoint-url", str(whole)]) == 0
    shutil.copytree(whole, parts)
    shutil.rmtree(parts / "step-6")
    metrics = tmp_path / "metrics.jsonl"
    assert main([*flags, "--checkpoint-url", str(parts), "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "resume"] == [4]
    assert not [r for r in records if r["event"] == "flags_changed"]
    a, b = storage.load_state_dict(str(whole), 6), storage.load_state_dict(str(parts), 6)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
