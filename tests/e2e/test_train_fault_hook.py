"""Where the training entry plugs the testing module in: without ``FTSDP_FAULT`` a real run of
``ftsdp.train`` never imports ``ftsdp.testing``; with it, the fault hook fires at its step."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    *["--vocab-size", "32", "--block-size", "8", "--n-layer", "1", "--n-head", "2"],
    *["--n-embd", "16", "--global-batch", "4", "--micro-batch", "2", "--steps", "3"],
    *["--warmup", "1", "--log-every", "1", "--device", "cpu"],
]
# Runs the entry in this interpreter, then reports whether ftsdp.testing was ever imported.
PROBE = (
    "import sys; from ftsdp.train import main; rc = main(sys.argv[1:]); "
    "print('ftsdp.testing imported:', any(m.split('.')[:2] == ['ftsdp', 'testing'] "
    "for m in sys.modules)); raise SystemExit(rc)"
)


def _run(tmp_path: pathlib.Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("FTSDP_FAULT")
    }
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
    ckpt = ["--checkpoint-url", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    return subprocess.run(
        [sys.executable, "-c", PROBE, *TINY, *ckpt],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(150)
def test_without_ftsdp_fault_the_entry_never_imports_testing(tmp_path) -> None:
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "done | 3 steps" in proc.stdout
    assert "ftsdp.testing imported: False" in proc.stdout


@pytest.mark.timeout(150)
def test_with_ftsdp_fault_the_hook_fires_at_its_step(tmp_path) -> None:
    log = tmp_path / "faults.jsonl"
    proc = _run(tmp_path, FTSDP_FAULT="exit:step=2:code=7", FTSDP_FAULT_LOG=str(log))
    assert proc.returncode == 7, proc.stderr[-4000:]
    assert "injecting fault exit at step 2 on rank 0" in proc.stderr
    assert "step 1/3" in proc.stdout and "step 2/3" not in proc.stdout  # before_save, step 2
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (record["kind"], record["step"], record["rank"]) == ("exit", 2, 0)
    assert record["incarnation"]  # the hook was made with the rank manager's incarnation
