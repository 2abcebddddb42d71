"""``ftsdp-ckpt`` as a real process: a conversion of a checkpoint three times the memory budget
stays within the budget (peak RSS measured), loading the model weights of a checkpoint that also
holds optimizer state needs about the weights' size, and the progress bar shows on a terminal
only (the exit codes of bad inputs are checked in process, tests/unit/tools/ckpt/test_cli.py)."""

from __future__ import annotations

import json
import os
import pathlib
import pty
import subprocess
import sys

import pytest
import torch

from ftsdp import storage

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20
BUDGET = 64 * MiB
SLACK = 16 * MiB  # allocator and interpreter noise on top of the budget
# Runs Python code in a fresh process and reports its peak RSS (VmHWM, which exec resets, unlike
# ru_maxrss that a child inherits from the forking pytest process) before and after the work: the
# baseline is the interpreter with torch, storage and the tool imported.
_MEASURE = (
    "import json, sys\n"
    "import storage, tools.ckpt\n"
    "def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024\n"
    "base = peak()\n"
    "{work}\n"
    "print(json.dumps({{'base': base, 'peak': peak(), 'result': result}}))\n"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _measure(work: str, *args: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(work=work), *args],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[str], int]:
    """A 192 MiB checkpoint: 64 MiB of model weights, 128 MiB of optimizer state (one tensor of
    96 MiB, larger than the whole budget)."""
    root = tmp_path_factory.mktemp("big") / "ckpt"
    model = {f"w{i}": torch.full((4 * MiB,), float(i)) for i in range(4)}  # 4 x 16 MiB
    optim = {"big": torch.full((24 * MiB,), 0.5), "m": torch.full((8 * MiB,), 1.5)}
    storage.save({"model": model, "optim": optim, "step": 1}, str(root), step=1)
    return root, [f"model.{k}" for k in model], sum(t.numel() * 4 for t in model.values())


@pytest.mark.timeout(200)
def test_convert_stays_within_the_memory_budget(big: tuple, tmp_path: pathlib.Path) -> None:
    root, _, _ = big
    size = sum(f.stat().st_size for f in root.rglob("*.safetensors"))
    assert size >= 3 * BUDGET
    argv = ["convert", str(root), str(tmp_path / "hf"), "--to", "hf", "--max-memory", "64MiB"]
    argv += ["--include-optimizer", "--keep-names"]  # all 192 MiB (hf default: the weights)
    run, err = _measure("result = tools.ckpt.main(sys.argv[1:])", *argv)
    assert run["result"] == 0, err
    assert err == ""  # no progress bar in a pipe
    grew = run["peak"] - run["base"]
    print(
        f"convert {size / MiB:.0f} MiB to hf: peak RSS {run['peak'] / MiB:.0f} MiB, before {run['base'] / MiB:.0f} MiB, +{grew / MiB:.0f} MiB (budget 64 MiB)"
    )
    assert grew <= BUDGET + SLACK, f"+{grew / MiB:.0f} MiB for a 64 MiB budget"
    got = storage.LazyStateDict(str(tmp_path / "hf"))
    assert torch.equal(got["optim.big"][-3:], torch.full((3,), 0.5))


@pytest.mark.timeout(200)
def test_model_weights_load_in_about_their_size(big: tuple) -> None:
    root, keys, model_bytes = big
    work = "sd = storage.load_state_dict(sys.argv[1], keys=sys.argv[2:]); result = sum(t.numel() for t in sd.values())"
    run, err = _measure(work, str(root), *keys)
    assert run["result"] * 4 == model_bytes, err
    grew = run["peak"] - run["base"]
    print(
        f"load {model_bytes / MiB:.0f} MiB of weights from a 192 MiB checkpoint: +{grew / MiB:.0f} MiB"
    )
    assert grew <= model_bytes + 24 * MiB, (
        f"+{grew / MiB:.0f} MiB for {model_bytes / MiB:.0f} MiB of weights"
    )


@pytest.mark.timeout(120)
def test_progress_on_a_terminal_only(tmp_path: pathlib.Path) -> None:
    src = str(tmp_path / "src")
    storage.save({"w": torch.zeros(1 << 20)}, src, step=1)
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ftsdp.tools.ckpt", "convert", src, str(tmp_path / "o"), "--to", "hf"],
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=slave, timeout=60,
        )  # fmt: skip
        os.close(slave)
        seen = b""
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the terminal has no writer left
                break
            if not data:
                break
            seen += data
    finally:
        os.close(master)
    assert proc.returncode == 0
    text = seen.decode()
    assert (
        "convert [" in text and "100%" in text and "4.0 MiB/4.0 MiB" in text and "/s ETA" in text
    ), text
    assert b"wrote hf" in proc.stdout
