"""Node loss: two torchrun agents on 127.0.0.1 (``--nnodes=1:2``, c10d rendezvous), one
process per agent. At a step boundary the second agent's worker SIGKILLs its agent, its sibling
workers and itself (``FTSDP_FAULT=kill_node:step=5:when=after_commit`` in that agent's
environment only: the whole node is gone at once, deterministically). The survivor's worker
fails its next collective, its agent re-rendezvouses alone (world size 1), the new worker
resumes from the newest committed step resharded, and the job ends equal to the uninterrupted
run. Once with the checkpoints in a local directory, once on a local S3 endpoint (moto).

The scenario is a node lost after step 5 with step 4's checkpoint committed. ``when=after_commit``
makes the doomed worker wait for the async save still in flight (step 4's) to commit before it
fires. Without it the kill raced the upload: on S3 under load step 4 had often not committed
0.2-0.4 s after it started, and the job (rightly) resumed from step 2 instead.

The first agent hosts the rendezvous store (``is_host=1``): the store of a c10d rendezvous lives
in one agent, and losing that one ends the job (docs/elastic.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ftsdp import storage
from ftsdp.testing import free_port
from tests.e2e.test_faults import STEPS, Run, check_against_reference, measure, reference
from tests.s3_fixture import s3_bucket_url, s3_endpoint  # noqa: F401 - fixtures

FAULT = "kill_node:step=5:when=after_commit"  # see the module docstring
RDZV = "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Run:
    return reference(tmp_path_factory.getbasetemp())


def _agent(run: Run, port: int, *, host: bool, env: dict[str, str], name: str):
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
    ]
    log = open(run.log_path(name), "w")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    return proc, log


def node_loss(run: Run, extra_env: dict[str, str] | None = None) -> dict:
    port = free_port()
    # The doomed agent first: it waits for the store host, so both join the first round together.
    doomed = _agent(run, port, host=False, env=run.env(FAULT, extra_env), name="b")
    time.sleep(0.5)
    survivor = _agent(run, port, host=True, env=run.env("", extra_env), name="a")
    try:
        rc = survivor[0].wait(timeout=240)
        doomed_rc = doomed[0].wait(timeout=30)
    finally:
        for proc, log in (doomed, survivor):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert rc == 0, run.output()[-8000:]
    assert doomed_rc == -9, (doomed_rc, run.output()[-8000:])
    starts = [r for r in run.metrics() if r["event"] == "start"]
    assert starts[0]["world_size"] == 2, "both nodes must start together"
    (resume,) = [r for r in run.metrics() if r["event"] == "resume"]
    assert (resume["saved_world_size"], resume["world_size"], resume["step"]) == (2, 1, 4)
    return resume


@pytest.mark.timeout(300)
def test_node_loss_survivor_continues_at_the_smaller_world_size(ref, tmp_path) -> None:
    run = Run(tmp_path / "node-loss")
    node_loss(run)
    check_against_reference(run, ref)
    m = measure(
        run,
        "node loss (2 agents -> 1), local directory",
        "2 x torchrun --nnodes=1:2 --rdzv-backend=c10d --max-restarts=3, "
        f"FTSDP_FAULT={FAULT} on the second",
    )
    assert m["steps_lost"] == 1 and m["world_sizes"] == "2 -> 1"


@pytest.mark.timeout(300)
def test_node_loss_with_checkpoints_on_s3(ref, tmp_path, s3_endpoint, s3_bucket_url) -> None:  # noqa: F811
    run = Run(tmp_path / "node-loss-s3", url=s3_bucket_url)
    node_loss(run, {"FTSDP_STORAGE_OPTIONS": json.dumps(s3_endpoint)})
    assert storage.list_steps(run.url, storage_options=s3_endpoint)[-1] == STEPS
    run.storage_options = s3_endpoint
    check_against_reference(run, ref)
    m = measure(
        run,
        "node loss (2 agents -> 1), S3 (moto)",
        "2 x torchrun --nnodes=1:2 --rdzv-backend=c10d --max-restarts=3, "
        f"--checkpoint-url s3://..., FTSDP_FAULT={FAULT} on the second",
    )
    assert m["steps_lost"] == 1
