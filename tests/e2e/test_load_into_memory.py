"""Peak memory of ``load_into`` into a real module, measured in a fresh process: staging costs
the loaded tensors' bytes once plus one 8 MiB chunk of reading, and ``max_staging_bytes`` bounds
it to a few chunks (a verify pass holds a chunk read and the reader's chunk; the allocator keeps
the first after it is freed, then the copy pass reads a chunk).

The work runs in a child whose peak RSS (VmHWM) is read before and after the load; the baseline
includes the module itself and a first small load (imports, thread pools)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from ftsdp import storage

REPO = pathlib.Path(__file__).resolve().parents[2]
MiB = 1 << 20
WEIGHTS = 8  # tensors of 8 MiB each: 64 MiB of float32 weights
CHUNK = 8 * MiB
NOISE = 8 * MiB  # allocator and interpreter

_CHILD = """
import json, sys, torch
from ftsdp import storage
def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
url, bound = sys.argv[1], (None if sys.argv[2] == 'none' else int(sys.argv[2]))
tiny = torch.nn.Linear(1, 1, bias=False)
storage.load_into(tiny, url, prefix='tiny.')
model = torch.nn.Module()
for i in range({n}):
    model.register_parameter(f'w{{i}}', torch.nn.Parameter(torch.zeros(2 * 1024 * 1024)))
base = peak()
result = storage.load_into(model, url, prefix='model.', max_staging_bytes=bound)
ok = all(bool((p == i).all()) for i, p in enumerate(model.parameters()))
print(json.dumps({{'grew': peak() - base, 'staged': result.staged_bytes, 'ok': ok}}))
"""


def _load(url: str, bound: int | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(n=WEIGHTS), url, str(bound).lower()],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.timeout(200)
def test_load_into_real_module_peak_memory(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "ckpt")
    model = {f"w{i}": torch.full((2 * MiB,), float(i)) for i in range(WEIGHTS)}
    storage.save({"model": model, "tiny": {"weight": torch.ones(1, 1)}}, url, step=1)
    weights = WEIGHTS * 8 * MiB
    staged = _load(url, None)
    bounded = _load(url, 8 * MiB)
    print(
        f"load_into {weights // MiB} MiB in place: +{staged['grew'] / MiB:.1f} MiB staged, "
        f"+{bounded['grew'] / MiB:.1f} MiB with max_staging_bytes=8MiB (read twice)"
    )
    assert staged["ok"] and bounded["ok"]
    assert staged["staged"] == weights and bounded["staged"] == 0
    assert weights <= staged["grew"] <= weights + CHUNK + NOISE
    assert bounded["grew"] <= 3 * CHUNK + NOISE
