"""The main job end to end: ``torchrun --standalone --nproc-per-node=2 -m ftsdp.train`` with the
real engine on gloo, a tiny model for a few seconds; then the same job as one plain process,
which must see the same samples per step and so log (almost) the same losses."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ftsdp.trainer._phases import MARKS, PHASES

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    *["--vocab-size", "64", "--block-size", "32", "--n-layer", "2", "--n-head", "2"],
    *["--n-embd", "64", "--global-batch", "16", "--micro-batch", "4", "--steps", "30"],
    *["--lr", "1e-2", "--warmup", "5", "--min-lr", "1e-3", "--log-every", "5", "--device", "cpu"],
]
# The entry's handler prefixes each line: time, rank, level, logger (ftsdp.trainer._session).
LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} rank 0 INFO ftsdp\.train: "
    r"step (\d+)/30 \| loss ([\d.]+) \| tokens/s (\d+) \| s/step ([\d.]+) \| grad_norm ([\d.]+)",
    re.M,
)


def _run(cmd: list[str], metrics: pathlib.Path, *extra: str) -> tuple[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [*cmd, *TINY, "--metrics", str(metrics), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return proc.stdout, records


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict]]:
    metrics = tmp_path_factory.mktemp("train") / "metrics.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    return _run([*torchrun, "-m", "ftsdp.train"], metrics)


@pytest.mark.timeout(180)
def test_torchrun_two_ranks_logs_and_the_loss_falls(two_ranks) -> None:
    stdout, records = two_ranks
    assert "ftsdp.train | world 2 | cpu | FULL_SHARD" in stdout
    lines = LINE.findall(stdout)
    assert [int(s) for s, *_ in lines] == [5, 10, 15, 20, 25, 30], stdout  # rank 0 only, once
    assert all(int(tps) > 0 and float(sps) > 0 for _, _, tps, sps, _ in lines)
    assert "done | 30 steps" in stdout

    start, *steps, done = [r for r in records if r["event"] != "phases"]
    assert start["event"] == "start" and start["world_size"] == 2 and start["accum_steps"] == 2
    assert [r["step"] for r in steps] == [5, 10, 15, 20, 25, 30] and done["event"] == "done"
    for (_, loss, *_), rec in zip(lines, steps, strict=True):
        assert float(loss) == pytest.approx(rec["loss"], abs=1e-4)
    first, last = steps[0]["loss"], steps[-1]["loss"]
    uniform, floor = start["loss_uniform"], start["loss_floor"]
    assert first > uniform - 0.6, (first, uniform)  # starts near ln(V)
    assert last < first - 1.5 and last < floor + 1.0, (first, last, floor)


@pytest.mark.timeout(180)
def test_the_first_step_records_where_the_worker_start_went(two_ranks) -> None:
    """One ``phases`` record (ftsdp/trainer/_phases.py): every mark from the kernel's process
    start to the first step, in order, around the start record written between them; the
    phases add up; one progress line says it."""
    stdout, records = two_ranks
    (phases,) = [r for r in records if r["event"] == "phases"]
    start = next(r for r in records if r["event"] == "start")
    marks = phases["marks"]
    assert list(marks) == list(MARKS)
    assert list(marks.values()) == sorted(marks.values())
    assert marks["built"] <= start["time"] <= marks["resumed"]  # run() logs the start between
    assert 0 <= marks["entry"] - marks["process_start"] < 5  # the kernel's clock and ours agree
    assert list(phases["seconds"]) == [name for name, _ in PHASES]
    assert sum(phases["seconds"].values()) == pytest.approx(phases["total_s"], abs=1e-3)
    assert (phases["world_size"], phases["restart_count"], phases["resumed_step"]) == (2, 0, None)
    (line,) = re.findall(r"rank 0 INFO ftsdp\.train: first step ([\d.]+)s after process", stdout)
    assert float(line) == pytest.approx(phases["total_s"], abs=0.006)


@pytest.mark.timeout(180)
def test_one_plain_process_sees_the_same_batches(two_ranks, tmp_path) -> None:
    stdout, records = _run([sys.executable, "-m", "ftsdp.train"], tmp_path / "metrics.jsonl")
    assert "ftsdp.train | world 1 | cpu" in stdout
    one = [r["loss"] for r in records if r["event"] == "step"]
    two = [r["loss"] for r in two_ranks[1] if r["event"] == "step"]
    # Same global samples per step and the same math: only the reduction order differs.
    assert one == pytest.approx(two, rel=1e-3)


@pytest.mark.timeout(180)
def test_rerunning_a_finished_job_says_so_and_a_resume_counts_its_own_steps(tmp_path) -> None:
    """The same command again after the job finished: one line saying it is complete at its
    step with the loss its last log line showed, no training, exit 0. With more --steps it
    resumes, and its done line counts the steps it trained (``steps 30->40``)."""
    ckpt = ["--checkpoint-url", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    entry = [sys.executable, "-m", "ftsdp.train"]
    stdout, records = _run(entry, tmp_path / "m1.jsonl", *ckpt)
    last = [r for r in records if r["event"] == "step"][-1]
    assert last["step"] == 30 and "done | 30 steps in" in stdout

    stdout, records = _run(entry, tmp_path / "m2.jsonl", *ckpt)
    (line,) = re.findall(r"ftsdp\.train: (already complete.*)", stdout)
    assert line == (
        f"already complete at step 30 (--steps 30): nothing to train | last logged loss "
        f"{last['loss']:.4f}"
    ), stdout
    assert "done |" not in stdout and "resumed" not in stdout and "nan" not in stdout
    assert "generation" not in stdout and "restart" not in stdout, stdout
    assert not [r for r in records if r["event"] in ("step", "resume", "checkpoint")]
    (done,) = [r for r in records if r["event"] == "done"]
    assert (done["first_step"], done["loss_step"], done["loss"]) == (30, 30, last["loss"])

    stdout, records = _run(entry, tmp_path / "m3.jsonl", *ckpt, "--steps", "40")
    assert "resumed step 30" in stdout and "the job's restart 1" in stdout
    assert [r["step"] for r in records if r["event"] == "step"] == [35, 40]
    assert re.search(r"done \| steps 30->40 in [\d.]+s \| final loss [\d.]+$", stdout, re.M)
