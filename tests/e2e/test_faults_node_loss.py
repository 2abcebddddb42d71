"""Node loss: two torchrun agents on 127.0.0.1 (``--nnodes=1:2``, c10d rendezvous), one
process per agent. At a step boundary the second agent's worker SIGKILLs its agent, its sibling
workers and itself (``FTSDP_FAULT=kill_node:step=5:when=after_commit`` in that agent's
environment only: the whole node is gone at once, deterministically). The survivor's worker
fails its next collective, its agent re-rendezvouses alone (world size 1), the new worker
resumes from the newest committed step resharded, and the job ends equal to the uninterrupted
run. Once with the checkpoints in a local directory and a memory tier every step (each agent
a simulated node with a memory root of its own, ``$FTSDP_NODE``; the lost node's root is wiped
once it is gone, and the survivor resumes step 5 from its replica of the lost node's shards: no
step lost), once on a local S3 server (SeaweedFS; durable checkpoints only: step 4, one step lost).

The scenario is a node lost after step 5 with step 4's checkpoint committed. ``when=after_commit``
makes the doomed worker wait for the async save still in flight (step 4's) to commit before it
fires. Without it the kill raced the upload: on S3 under load step 4 had often not committed
0.2-0.4 s after it started, and the job (rightly) resumed from step 2 instead.

The two jobs run side by side (``jobs``): each spends seconds idle while the rendezvous gives up
on the lost node (keep-alive and last-call timeouts), so together they take much less than the
two in turn. When the suite measures (``$FTSDP_FAULT_REPORT`` set) they run one after
the other, so that the times it reports are each job's alone.

The first agent hosts the rendezvous store (``is_host=1``): the store of a c10d rendezvous lives
in one agent, and losing that one ends the job (docs/elastic.md).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from ftsdp import storage
from ftsdp.testing import free_ports
from tests.e2e.test_faults import (
    STEPS,
    Run,
    check_against_reference,
    measure,
    reference,
    side_by_side,
)
from tests.s3_fixture import new_bucket_url

FAULT = "kill_node:step=5:when=after_commit"  # see the module docstring
# last_call_timeout: how long a round stays open for more agents once one has joined (see
# node_loss); only the survivor's rendezvous after the loss waits for all of it.
RDZV = "join_timeout=90,last_call_timeout=6,keep_alive_interval=1,keep_alive_max_attempt=3"


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Run:
    return reference(tmp_path_factory.getbasetemp())


def _agent(run: Run, port: int, *, host: bool, env: dict[str, str], name: str, extra=()):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=node-loss-{port}",
        f"--rdzv-conf=is_host={int(host)},{RDZV}",
        "--max-restarts=3",
        "--monitor-interval=0.2",
        "-m",
        "ftsdp.train",
        *run.args(),
        *extra,
    ]
    path = run.log_path(name)
    log = open(path, "w")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, log, path


# torchrun logs this (at INFO) once its imports are done, just before it connects to the
# rendezvous store: from then on it joins within ~0.1 s of the store coming up.
READY = "Starting elastic_operator with launch configs"


def _wait_until_ready(proc: subprocess.Popen, path: pathlib.Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while READY not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"exit {proc.returncode}: {path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {READY!r} after {timeout}s in {path}"
        time.sleep(0.05)


def _memory_tier(shm: pathlib.Path | None, node: str) -> tuple[list[str], dict[str, str]]:
    """The arguments and environment of agent ``node``'s memory tier: every step, in a root
    of that node's own (``$FTSDP_NODE`` names the simulated node)."""
    if shm is None:
        return [], {}
    return ["--memory-every", "1", "--memory-url", str(shm / node)], {"FTSDP_NODE": node}


def node_loss(
    run: Run, port: int, extra_env: dict[str, str] | None = None, shm: pathlib.Path | None = None
) -> dict:
    """One node-loss job to its end (``port``: the rendezvous store's); its resume record.
    With ``shm`` each agent has a memory tier of its own under it (a simulated node's shared
    memory), and the lost node's is wiped once it is gone."""
    # Both agents must join the first round: with --nnodes=1:2 a round closes last_call_timeout
    # after the first agent joined. Were the host alone in it, the next round (with the doomed
    # agent, which has the lower pid) would make the doomed agent rank 0, and torch 2.13's c10d
    # handler keeps the host's cached worker store while the doomed agent makes its own: their
    # workers never meet, the job fails after its restarts. So the doomed agent starts first and
    # the host only once the doomed one is done importing and waits for the store (imports alone
    # differ by seconds under load), and the round stays open 6 s (with 2 s, at load 4-7 with
    # both jobs side by side, the doomed agent joined too late in 2 runs of 7).
    args_b, env_b = _memory_tier(shm, "b")
    args_a, env_a = _memory_tier(shm, "a")
    doomed = _agent(
        run, port, host=False,
        env=run.env(FAULT, {**(extra_env or {}), **env_b, "LOGLEVEL": "INFO"}), name="b",
        extra=args_b,
    )  # fmt: skip
    survivor = None
    try:
        _wait_until_ready(doomed[0], doomed[2])
        survivor = _agent(
            run, port, host=True, env=run.env("", {**(extra_env or {}), **env_a}), name="a",
            extra=args_a,
        )  # fmt: skip
        doomed_rc = doomed[0].wait(timeout=240)
        if shm is not None:  # the lost node's shared memory is gone with it
            shutil.rmtree(shm / "b", ignore_errors=True)
        rc = survivor[0].wait(timeout=240)
    finally:
        for proc, log, _ in filter(None, (doomed, survivor)):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert rc == 0, run.output()[-8000:]
    assert doomed_rc == -9, (doomed_rc, run.output()[-8000:])
    starts = [r for r in run.metrics() if r["event"] == "start"]
    assert starts[0]["world_size"] == 2, "both nodes must start together"
    (resume,) = [r for r in run.metrics() if r["event"] == "resume"]
    want = (2, 1, 5, "memory") if shm is not None else (2, 1, 4, "durable")
    got = (resume["saved_world_size"], resume["world_size"], resume["step"], resume.get("tier"))
    assert got == want, got
    return resume


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, s3_endpoint) -> Iterator[dict[str, tuple[Run, Future]]]:
    """Both jobs, started side by side (see the module docstring): per job its run and the
    future of :func:`node_loss`, which each test waits for."""
    root = tmp_path_factory.mktemp("node-loss")
    local = Run(root / "node-loss")  # with the memory tier: resumes from the replica
    shm = root / "shm"
    s3 = Run(root / "node-loss-s3", url=new_bucket_url(s3_endpoint))
    s3_env = {"FTSDP_STORAGE_OPTIONS": json.dumps(s3_endpoint)}
    port_local, port_s3 = free_ports(2)
    if not side_by_side():  # measuring: the reference first, then one job after the other
        reference(tmp_path_factory.getbasetemp())
    with ThreadPoolExecutor(2 if side_by_side() else 1, thread_name_prefix="node-loss") as pool:
        yield {
            "local": (local, pool.submit(node_loss, local, port_local, None, shm)),
            "s3": (s3, pool.submit(node_loss, s3, port_s3, s3_env)),
        }


@pytest.mark.timeout(300)
def test_node_loss_survivor_continues_at_the_smaller_world_size(jobs, ref) -> None:
    run, job = jobs["local"]
    job.result(timeout=280)
    check_against_reference(run, ref)
    m = measure(
        run,
        "node loss (2 agents -> 1), local directory, memory tier (its shared memory wiped)",
        "2 x torchrun --nnodes=1:2 --rdzv-backend=c10d --max-restarts=3, --memory-every 1 "
        f"--memory-url <one per agent>, FTSDP_NODE=a/b, FTSDP_FAULT={FAULT} on the second",
    )
    # step 5 comes back from the survivor's replica of the lost node's shards
    assert m["steps_lost"] == 0 and m["world_sizes"] == "2 -> 1"


@pytest.mark.timeout(300)
def test_node_loss_with_checkpoints_on_s3(jobs, ref, s3_endpoint) -> None:
    run, job = jobs["s3"]
    job.result(timeout=280)
    assert storage.list_steps(run.url, storage_options=s3_endpoint)[-1] == STEPS
    run.storage_options = s3_endpoint
    check_against_reference(run, ref)
    m = measure(
        run,
        "node loss (2 agents -> 1), S3 (SeaweedFS)",
        "2 x torchrun --nnodes=1:2 --rdzv-backend=c10d --max-restarts=3, "
        f"--checkpoint-url s3://..., FTSDP_FAULT={FAULT} on the second",
    )
    assert m["steps_lost"] == 1
