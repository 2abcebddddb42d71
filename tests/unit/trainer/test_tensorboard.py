"""``ftsdp.train --tensorboard DIR``: the scalars TensorBoard reads back (its own event reader)
are the ``--metrics`` records of the same run, a resumed run adds its own event file to the same
directory, and a missing tensorboard package is one line and exit status 2 before training."""

from __future__ import annotations

import json
import sys

import pytest

from ftsdp.train import main

TINY = [
    *["--vocab-size", "16", "--block-size", "8", "--n-layer", "1", "--n-head", "1"],
    *["--n-embd", "8", "--global-batch", "2", "--micro-batch", "2", "--steps", "3"],
    *["--log-every", "1", "--device", "cpu", "--heartbeat-timeout-s", "0"],
    *["--checkpoint-every", "2", "--warmup", "1"],
]
STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "s_per_step": "perf/s_per_step",
    "world_size": "elastic/world_size",
    "restarts": "elastic/restarts",
}


@pytest.fixture
def world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTSDP_FAULT"):
        monkeypatch.delenv(key, raising=False)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scalars(logdir) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_the_scalars_are_the_metrics_records_and_a_resume_adds_its_own(world_of_one, tmp_path):
    metrics, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    argv = [*TINY, "--metrics", str(metrics), "--tensorboard", str(tb)]
    argv += ["--checkpoint-url", str(tmp_path / "ck")]
    assert main(argv) == 0
    assert main([*argv, "--steps", "4"]) == 0  # resumes from step 3: a second incarnation
    assert len(list(tb.iterdir())) == 2  # one event file per incarnation, one run to TensorBoard
    records = _records(metrics)
    scalars = _scalars(tb)
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for key, tag in STEP_TAGS.items():
        if tag == "elastic/world_size":
            continue  # below: the resume writes it too
        got = scalars.pop(tag)
        assert [(s, w) for s, _, w in got] == [(r["step"], r["time"]) for r in steps], tag
        assert [v for _, v, _ in got] == pytest.approx([r[key] for r in steps], rel=1e-6), tag
    saves = [r for r in records if r["event"] == "checkpoint"]
    assert [r["step"] for r in saves] == [2, 3, 4]
    blocking = scalars.pop("checkpoint/blocking_s")
    assert [(s, w) for s, _, w in blocking] == [(r["step"], r["time"]) for r in saves]
    assert [v for _, v, _ in blocking] == pytest.approx([r["blocking_s"] for r in saves], rel=1e-6)
    (resume,) = [r for r in records if r["event"] == "resume"]
    (point,) = scalars.pop("elastic/resume_s")
    assert point == (3, pytest.approx(resume["seconds"], rel=1e-6), resume["time"])
    world = [(r["step"], 1.0, r["time"]) for r in steps]
    world.insert(3, (3, 1.0, resume["time"]))  # at the step it loaded, before step 4
    assert scalars.pop("elastic/world_size") == world
    assert scalars == {}


def test_a_missing_tensorboard_is_one_line_and_exit_2_before_training(
    world_of_one, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    metrics, tb = tmp_path / "metrics.jsonl", tmp_path / "tb"
    assert main([*TINY, "--metrics", str(metrics), "--tensorboard", str(tb)]) == 2
    out, err = capsys.readouterr()
    (line,) = err.splitlines()
    assert line.endswith(
        f"rank 0 ERROR ftsdp.train: error: --tensorboard {tb} needs the tensorboard package: "
        "pip install 'ftsdp[tensorboard]' (or pip install tensorboard)"
    )
    assert "step 1/3" not in out and not tb.exists()
    assert [r["event"] for r in _records(metrics)] == ["error"]  # nothing trained
