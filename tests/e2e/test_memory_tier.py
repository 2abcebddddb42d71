"""The memory tier under an elastic agent (``python -m ftsdp.launch``, torchrun's agent with
forked workers): a worker killed with SIGKILL right after step 4's memory save committed comes
back from that step (no step lost), and the run ends bitwise equal to an uninterrupted
single-process run of the same job (``--deterministic``)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from ftsdp import storage

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 6
TINY = [
    *["--vocab-size", "64", "--block-size", "16", "--n-layer", "1", "--n-head", "2"],
    *["--n-embd", "32", "--global-batch", "4", "--micro-batch", "1", "--steps", str(STEPS)],
    *["--warmup", "1", "--log-every", "1", "--device", "cpu", "--deterministic"],
    *["--checkpoint-every", "3", "--keep-last", "5", "--pg-timeout-s", "60"],
]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("FTSDP_FAULT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, **extra}


def _jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def persisters(tag: str) -> list[int]:
    """The live persister processes whose environment carries ``FTSDP_TEST_TAG=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if (
            b"ftsdp.checkpoint._persister" in cmdline
            and f"FTSDP_TEST_TAG={tag}".encode() in environ
        ):
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run (one plain process), started once beside the module's jobs;
    calling the fixture's value waits for it and gives its checkpoint root."""
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    cmd = [sys.executable, "-m", "ftsdp.train", *TINY, "--checkpoint-url", str(root)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    done: list[str] = []

    def result() -> str:
        if not done:
            out, _ = proc.communicate(timeout=200)
            assert proc.returncode == 0, out[-3000:]
            done.append(str(root))
        return done[0]

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _same_final_state(reference: str, ckpt: str) -> None:
    want = storage.load_state_dict(reference, step=STEPS)
    got = storage.load_state_dict(ckpt, step=STEPS)
    tensors = [k for k in want if k.startswith(("model.", "optim.state."))]
    assert tensors and all(torch.equal(got[k], want[k]) for k in tensors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("persister", [False, True], ids=["in-process", "persister"])
def test_kill9_resumes_from_the_memory_tier_without_losing_a_step(
    tmp_path: pathlib.Path, persister: bool, reference
) -> None:
    shm = tmp_path / "shm"
    cmd = [  # ftsdp.launch: torchrun's agent, workers forked with their imports done
        *[sys.executable, "-m", "ftsdp.launch", "--standalone", "--nproc-per-node=2"],
        *["--max-restarts=1", "--", *TINY],
        *["--checkpoint-url", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "m.jsonl")],
        *["--memory-every", "1", "--memory-url", str(shm)],
        *(["--persister"] if persister else []),
    ]
    env = _env(
        FTSDP_FAULT="kill:rank=1:step=4:when=after_commit",
        FTSDP_FAULT_LOG=str(tmp_path / "faults.jsonl"),
        FTSDP_TEST_TAG=str(tmp_path),
    )
    job = subprocess.run(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=200,
        check=False,
    )
    assert job.returncode == 0, job.stdout[-3000:]
    outs = [None, job.stdout]
    # the survivor's one line names the step the restart resumes from, and its tier
    lost = re.findall(r"ERROR ftsdp\.train: (peer lost.*)", outs[1])
    # (the persister tells a rank of a commit a little later: the survivor may not know of 4's)
    said = (
        r"the restart resumes from step (4 \(memory\)|3 \(\w+\))$"
        if persister
        else r"step 4 \(memory\)$"
    )
    assert lost and re.search(said, lost[0]), outs[1][-3000:]
    assert not re.search(r"^Traceback", outs[1], re.M), outs[1][-3000:]

    records = _jsonl(tmp_path / "m.jsonl")
    resumes = [r for r in records if r["event"] == "resume"]
    assert [(r["step"], r["tier"]) for r in resumes] == [(4, "memory")]  # step 4 not lost
    [fault] = _jsonl(tmp_path / "faults.jsonl")
    first_new = min(r["time"] for r in records if r["event"] == "step" and r.get("step", 0) > 4)
    print(f"kill -9 to first new step: {first_new - fault['time']:.2f} s")
    assert storage.list_steps(str(tmp_path / "ckpt")) == [3, 6]  # durable saves unchanged
    assert not shm.exists()  # cleared at the clean end
    assert persisters(str(tmp_path)) == []
    _same_final_state(reference(), str(tmp_path / "ckpt"))


@pytest.mark.timeout(240)
def test_sigterm_commits_the_persisted_step_and_leaves_no_persister(
    tmp_path: pathlib.Path, reference
) -> None:
    """SIGTERM to the agent at step 4 with the persister: the preemption's save of step 4 is
    committed to the durable root before the job exits (every process of the job gets the
    signal, the persister too), no persister is left, and the job resumed at world size 1
    from step 4 ends bitwise equal to the uninterrupted run."""
    args = [
        *TINY,
        *["--checkpoint-url", str(tmp_path / "ckpt"), "--metrics", str(tmp_path / "m.jsonl")],
        *["--memory-every", "1", "--memory-url", str(tmp_path / "shm"), "--persister"],
    ]

    def launch(nproc: int, **extra: str) -> str:
        cmd = [sys.executable, "-m", "ftsdp.launch", "--standalone", f"--nproc-per-node={nproc}"]
        run = subprocess.run(
            [*cmd, "--max-restarts=0", "--", *args],
            cwd=REPO,
            env=_env(FTSDP_TEST_TAG=str(tmp_path), **extra),
            capture_output=True,
            text=True,
            timeout=150,
        )
        out = run.stdout + run.stderr
        assert not persisters(str(tmp_path))  # every way the job ended: no persister left
        # the agent's shutdown frees its finished workers (none killed after its 30 s wait)
        assert "forcefully exiting" not in out, out[-3000:]
        return out

    out = launch(
        2,
        FTSDP_FAULT="term:rank=0:step=4:target=agent",
        FTSDP_FAULT_LOG=str(tmp_path / "faults.jsonl"),
    )
    assert "SignalException" in out, out[-3000:]
    stops = [r for r in _jsonl(tmp_path / "m.jsonl") if r["event"] == "preempted"]
    assert len(stops) == 1 and stops[0]["step"] in storage.list_steps(str(tmp_path / "ckpt"))
    out = launch(1)
    resumes = [r for r in _jsonl(tmp_path / "m.jsonl") if r["event"] == "resume"]
    assert [(r["step"], r["tier"], r["world_size"]) for r in resumes] == [
        (stops[0]["step"], "durable", 1)
    ], out[-3000:]
    _same_final_state(reference(), str(tmp_path / "ckpt"))


@pytest.mark.timeout(120)
def test_a_run_without_memory_every_names_the_memory_tier_an_earlier_run_left(
    tmp_path: pathlib.Path,
) -> None:
    """The default memory tier of this root (``/dev/shm/ftsdp-<uid>-<hash>``) holds a step from
    an earlier run with ``--memory-every``; a run without it resumes from the durable root and
    says where that tier is, what it holds and what to do (it stayed there unsaid), and leaves
    it alone."""
    from ftsdp.trainer._config import TrainConfig
    from ftsdp.trainer._job import memory_root

    url = str(tmp_path / "ckpt")
    shm = pathlib.Path(memory_root(TrainConfig(), url))
    assert not shm.exists()
    shm.mkdir(mode=0o700)
    try:
        storage.save({"w": torch.zeros(500_000)}, str(shm), 5)  # 2 MB
        cmd = [sys.executable, "-m", "ftsdp.train", *TINY, "--steps", "1", "--checkpoint-url", url]
        job = subprocess.run(
            cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=100, check=False
        )
        assert job.returncode == 0, job.stderr[-3000:]
        said = re.findall(r"WARNING ftsdp\.trainer\._job: (.*)", job.stderr)
        assert said == [
            f"ftsdp.train: the memory tier {shm} of an earlier run holds step 5 (2.0 MB of host "
            "memory); without --memory-every this run neither loads nor clears it: add "
            "--memory-every N to resume from it (and keep using it), or remove the directory"
        ], job.stderr[-3000:]
        assert storage.list_steps(str(shm)) == [5]
    finally:
        shutil.rmtree(shm, ignore_errors=True)  # the test's own
