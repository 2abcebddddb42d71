"""The main job on one GPU (``--device cuda``, NCCL), killed with ``kill -9`` after a commit and
restarted by ``ftsdp.launch``: it resumes from the last committed step, sees the samples the
uninterrupted run saw, and follows its losses. Skipped where there is no GPU (``bash
tools/gpu_check.sh`` runs it on one).

CUDA's kernels need not give the same bits run to run, so the losses and the final state are
compared within a tolerance; the samples, the steps and the resume point exactly.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.e2e.test_faults import STEPS, Run, _resumes, _steps, effective

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(400),
]

DEVICE = "cuda"


class OnDevice(Run):
    """A job of the fault suite's shape, on ``DEVICE``."""

    def args(self) -> list[str]:
        args = super().args()
        at = args.index("--device")
        return [*args[:at], "--device", DEVICE, *args[at + 2 :]]


def test_a_job_killed_on_the_gpu_resumes_and_follows_the_uninterrupted_run(tmp_path) -> None:
    ref = OnDevice(tmp_path / "reference")
    rc = ref.run([sys.executable, "-m", "ftsdp.train"], ref.env(), "python", timeout=180)
    assert rc == 0, ref.output()[-4000:]
    job = OnDevice(tmp_path / "job")
    kill = "kill:rank=0:step=5:when=after_commit:restart=0"
    rc = job.torchrun(1, faults=kill, max_restarts=1, timeout=240, launch=True)
    assert rc == 0, job.output()[-6000:]

    assert [r["step"] for r in _resumes(job)] == [4]  # step 4 committed, 5 lost with the kill
    mine, theirs = effective(job.ledger()), effective(ref.ledger())
    assert sorted(mine) == list(range(1, STEPS + 1))
    assert {s: r["ids"] for s, r in mine.items()} == {s: r["ids"] for s, r in theirs.items()}
    losses = {s: r["loss"] for s, r in effective(_steps(job)).items()}
    ref_losses = {s: r["loss"] for s, r in effective(_steps(ref)).items()}
    assert sorted(losses) == sorted(ref_losses) == list(range(1, STEPS + 1))
    for s in losses:
        assert losses[s] == pytest.approx(ref_losses[s], rel=1e-4, abs=1e-5), s
    final, expected = job.final(), ref.final()
    assert final.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(final[k], expected[k], rtol=1e-4, atol=1e-5, msg=k)
