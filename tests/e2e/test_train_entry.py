"""The main job end to end: ``torchrun --standalone --nproc-per-node=2 -m ftsdp.train`` with the
real engine on gloo, a tiny model for a few seconds; then the same job as one plain process and
at world sizes 3 and 4 (uneven shares of the default 4 micro-batches at 3), which must see the
same samples per step and so log the same losses; and a bad command line under torchrun."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from ftsdp import storage
from ftsdp.storage.catalog import read_manifest
from ftsdp.trainer._phases import MARKS, PHASES

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    *["--vocab-size", "64", "--block-size", "32", "--n-layer", "2", "--n-head", "2"],
    *["--n-embd", "64", "--steps", "30"],  # the default batch: 32 = 4 micro-batches of 8
    *["--lr", "1e-2", "--warmup", "5", "--min-lr", "1e-3", "--log-every", "5", "--device", "cpu"],
]
# The entry's handler prefixes each line: time, rank, level, logger (ftsdp.trainer._session).
LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} rank 0 INFO ftsdp\.train: "
    r"step (\d+)/30 \| loss ([\d.]+) \| tokens/s (\d+) \| s/step ([\d.]+) \| grad_norm ([\d.]+)",
    re.M,
)


def _launch(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


def _run(cmd: list[str], metrics: pathlib.Path, *extra: str) -> tuple[str, list[dict]]:
    proc = _launch([*cmd, *TINY, "--metrics", str(metrics), *extra])
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return proc.stdout, records


def _torchrun(world: int) -> list[str]:
    return [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone"],
        *[f"--nproc-per-node={world}", "-m", "ftsdp.train"],
    ]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[str, list[dict], float]:
    """The job's output, its records, and the wall time just before torchrun was started."""
    launched = time.time()
    return (*_run(_torchrun(2), tmp_path_factory.mktemp("train") / "metrics.jsonl"), launched)


@pytest.mark.timeout(180)
def test_torchrun_two_ranks_logs_and_the_loss_falls(two_ranks) -> None:
    stdout, records, _ = two_ranks
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
    stdout, records, launched = two_ranks
    (phases,) = [r for r in records if r["event"] == "phases"]
    start = next(r for r in records if r["event"] == "start")
    marks = phases["marks"]
    assert list(marks) == list(MARKS)
    assert list(marks.values()) == sorted(marks.values())
    assert marks["built"] <= start["time"] <= marks["resumed"]  # run() logs the start between
    # the kernel's clock and ours agree: the worker started after this test launched torchrun
    # (to a clock tick or two), and before its entry ran
    assert launched - 0.05 <= marks["process_start"] <= marks["entry"], (launched, marks)
    assert list(phases["seconds"]) == [name for name, _ in PHASES]
    assert sum(phases["seconds"].values()) == pytest.approx(phases["total_s"], abs=1e-3)
    assert (phases["world_size"], phases["restart_count"], phases["resumed_step"]) == (2, 0, None)
    (line,) = re.findall(r"rank 0 INFO ftsdp\.train: first step ([\d.]+)s after process", stdout)
    assert float(line) == pytest.approx(phases["total_s"], abs=0.006)


@pytest.mark.timeout(480)
def test_every_world_size_logs_the_same_loss_curve(two_ranks, tmp_path) -> None:
    """One plain process, and torchrun at 3 (shares 2, 1, 1: the short ranks pad) and 4 ranks:
    the same global samples per step and the exact mean gradient; only the order of the
    floating-point reductions differs."""
    stdout, records = _run([sys.executable, "-m", "ftsdp.train"], tmp_path / "metrics-1.jsonl")
    assert "ftsdp.train | world 1 | cpu" in stdout
    assert "global batch 32 = micro 8 x 4 over 1 rank (4 each)" in stdout
    one = [r["loss"] for r in records if r["event"] == "step"]
    curves = {2: [r["loss"] for r in two_ranks[1] if r["event"] == "step"]}
    for world in (3, 4):
        stdout, records = _run(_torchrun(world), tmp_path / f"metrics-{world}.jsonl")
        start = next(r for r in records if r["event"] == "start")
        assert (start["world_size"], start["accum_steps"]) == (world, 2 if world == 3 else 1)
        curves[world] = [r["loss"] for r in records if r["event"] == "step"]
        shares = "2-1" if world == 3 else "1"
        assert f"global batch 32 = micro 8 x 4 over {world} ranks ({shares} each)" in stdout
    for world, curve in curves.items():
        assert len(curve) == len(one) == 6
        assert curve == pytest.approx(one, rel=2e-5, abs=0), world


@pytest.mark.timeout(240)
def test_a_bad_command_line_is_one_line_from_rank_0_and_no_restart() -> None:
    """Every rank meets the error; rank 0 alone says it, in one line, and exits 2. torchrun
    restarts a failed worker group whatever its status (docs/training.md), so ftsdp.launch checks
    the flags itself before it starts one: with --max-restarts=3 nothing starts or retries."""
    bad = ["--global-batch", "30", "--micro-batch", "8", "--device", "cpu"]
    message = (
        "ftsdp-train: error: TrainConfig: global_batch=30 must be a multiple of micro_batch=8 "
        "(see ftsdp-train --help)"
    )
    proc = _launch([*_torchrun(2)[:-2], "--max-restarts=0", "-m", "ftsdp.train", *bad])
    assert proc.returncode != 0
    assert proc.stderr.count("ftsdp-train: error") == 1 and message in proc.stderr.splitlines()
    assert "exitcode  : 2" in proc.stderr, proc.stderr  # rank 0's status, in torchrun's summary
    launch = [sys.executable, "-m", "ftsdp.launch", "--standalone", "--nproc-per-node=2"]
    proc = _launch([*launch, "--max-restarts=3", "--", *bad])
    assert (proc.returncode, proc.stderr.splitlines(), proc.stdout) == (2, [message], "")


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


@pytest.mark.timeout(240)
def test_a_second_job_on_the_same_root_stops_the_first_with_one_line(tmp_path) -> None:
    """The same command started twice on one root: job A resumes (nothing there), stops itself
    at step 3 (SIGSTOP); job B trains to the end, committing steps 10, 20 and 30; A continues,
    and its save of step 10 fails with one line naming the other writer's steps, exit 2, no
    traceback. B's steps stay, and they are B's."""
    ckpt = ["--checkpoint-url", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    entry = [sys.executable, "-m", "ftsdp.train", *TINY, *ckpt]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "FTSDP_FAULT": "stop:step=3"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    a = subprocess.Popen(entry, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _state(a.pid) != "T":  # stopped by its fault
            assert a.poll() is None and time.monotonic() < deadline, "job A did not stop"
            time.sleep(0.1)
        _, records = _run(
            [sys.executable, "-m", "ftsdp.train"], tmp_path / "b.jsonl", *ckpt, "--seed", "7"
        )
        os.kill(a.pid, signal.SIGCONT)
        out, err = (b.decode() for b in a.communicate(timeout=120))
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode == 2, f"exit {a.returncode}\n{out}\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    (line,) = [x for x in err.splitlines() if " ERROR " in x]
    assert "error: another job is saving to" in line and "[10, 20, 30]" in line, line
    assert "found no committed step when it started" in line, line
    assert storage.list_steps(str(tmp_path / "ckpt")) == [10, 20, 30]
    (done,) = [r for r in records if r["event"] == "done"]
    values = read_manifest(str(tmp_path / "ckpt"), 30).values
    assert json.loads(values["trainer.config"])["seed"] == 7  # B's (A runs with seed 0)
    assert values["trainer.loss"] == done["loss"]


@pytest.mark.timeout(300)
def test_the_loser_of_a_root_is_not_restarted_into_the_other_jobs_steps(tmp_path) -> None:
    """As above, the same command twice (same flags: nothing tells the runs apart), with job A
    under torchrun that may restart it twice: after its refused save, each restart refuses at
    once, naming the lost root, instead of resuming B's steps (it used to resume B's step 30
    and exit 0 as "already complete"); torchrun then gives up. B's steps stay, and they are
    B's."""
    ckpt = ["--checkpoint-url", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    torchrun = [*_torchrun(1)[:-3], "--max-restarts=2", "--nproc-per-node=1", "-m", "ftsdp.train"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "FTSDP_FAULT": "stop:step=3"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    a = subprocess.Popen(
        [*torchrun, *TINY, *ckpt], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 150
        while (worker := _stopped_child(a.pid)) is None:  # stopped by its fault
            assert a.poll() is None and time.monotonic() < deadline, "job A did not stop"
            time.sleep(0.1)
        _, records = _run([sys.executable, "-m", "ftsdp.train"], tmp_path / "b.jsonl", *ckpt)
        os.kill(worker, signal.SIGCONT)
        out, err = (b.decode() for b in a.communicate(timeout=200))
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode != 0, f"exit {a.returncode}\n{out}\n{err[-4000:]}"
    errors = [x for x in err.splitlines() if " ERROR ftsdp.train" in x]
    assert len(errors) == 3, err[-6000:]  # the refused save, then each of the 2 restarts
    assert "error: another job is saving to" in errors[0], errors[0]
    for line in errors[1:]:
        assert "an earlier incarnation of this run lost" in line and "[10, 20, 30]" in line, line
    assert "already complete" not in out + err and "resumed" not in out + err, out[-3000:]
    assert storage.list_steps(str(tmp_path / "ckpt")) == [10, 20, 30]
    (done,) = [r for r in records if r["event"] == "done"]
    values = read_manifest(str(tmp_path / "ckpt"), 30).values
    assert values["trainer.loss"] == done["loss"]  # B's


def _stopped_child(pid: int) -> int | None:
    """A stopped child process of ``pid`` (torchrun's worker), if there is one."""
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] == "T" and int(fields[1]) == pid:
            return int(stat.parent.name)
    return None


def _state(pid: int) -> str:
    """A process's state letter (``/proc/<pid>/stat``): ``T`` when stopped."""
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(240)
def test_a_wrong_launch_environment_is_one_line_and_exit_2() -> None:
    """torchrun's variables set by hand, wrongly: one line naming the variable, exit 2, no
    traceback (they were tracebacks, exit 1). One process with only ``TORCHELASTIC_RUN_ID``
    (no store to watch) trains: its watchdog once failed on the missing store."""
    cases = {
        "RANK=abc": "environment variable RANK='abc' must be an integer",
        "WORLD_SIZE=2 RANK=0": (
            "WORLD_SIZE=2 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun"
        ),
        "LOCAL_RANK=3 LOCAL_WORLD_SIZE=2": "LOCAL_RANK=3 must be in [0, LOCAL_WORLD_SIZE=2)",
    }
    cmd = [sys.executable, "-m", "ftsdp.train", *TINY, "--steps", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "LOCAL"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for given, said in cases.items():
        extra = dict(pair.split("=") for pair in given.split())
        proc = subprocess.run(
            cmd, cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=150
        )
        assert proc.returncode == 2, (given, proc.stderr[-3000:])
        assert proc.stderr.strip().splitlines() == [f"ftsdp.train: error: {said}"], (
            given,
            proc.stderr[-3000:],
        )
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**env, "TORCHELASTIC_RUN_ID": "by-hand"},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
