"""The job on a real S3 server (SeaweedFS): ``torchrun --nproc-per-node=2 -m ftsdp.train`` with
its checkpoints on ``s3://`` (``--checkpoint-url``, the endpoint in ``$FTSDP_STORAGE_OPTIONS``),
rank 1 SIGKILLed after step 5 (``FTSDP_FAULT=kill:rank=1:step=5``, no restarts: the launch
fails), then resumed by ``torchrun --nproc-per-node=3`` from the newest step committed on S3.
The job ends equal to the uninterrupted run (tests/e2e/test_faults.py's checks: per-step
losses, final weights and optimizer state bitwise, the sample ledger).
"""

from __future__ import annotations

import json
import sys

import pytest

from ftsdp import storage
from tests.e2e.test_faults import STEPS, Run, check_against_reference, reference
from tests.s3_fixture import new_bucket_url


@pytest.mark.timeout(480)
def test_kill9_then_resume_at_world_3_from_s3_equals_the_uninterrupted_run(
    tmp_path_factory,
    s3_endpoint,
) -> None:
    ref = reference(tmp_path_factory.getbasetemp())
    run = Run(tmp_path_factory.mktemp("kill9-s3") / "job", url=new_bucket_url(s3_endpoint))
    run.storage_options = s3_endpoint
    s3 = {"FTSDP_STORAGE_OPTIONS": json.dumps(s3_endpoint)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--max-restarts=0", "--monitor-interval=0.2"]
    train = ["-m", "ftsdp.train"]

    env = run.env("kill:rank=1:step=5", s3)
    rc = run.run([*torchrun, "--nproc-per-node=2", *train], env, "torchrun-w2", timeout=200)
    assert rc != 0, run.output()[-6000:]  # rank 1 SIGKILLed after step 5
    assert [(f["step"], f["rank"]) for f in run.faults()] == [(5, 1)], run.faults()
    committed = storage.list_steps(run.url, storage_options=s3_endpoint)
    assert committed and committed[-1] in (2, 4), committed  # 4 unless its save was in flight

    rc = run.run([*torchrun, "--nproc-per-node=3", *train], run.env("", s3), "torchrun-w3", 200)
    assert rc == 0, run.output()[-6000:]
    resumes = [r for r in run.metrics() if r["event"] == "resume"]
    assert [(r["saved_world_size"], r["world_size"], r["step"]) for r in resumes] == [
        (2, 3, committed[-1])
    ]
    assert storage.list_steps(run.url, storage_options=s3_endpoint)[-1] == STEPS
    check_against_reference(run, ref)
