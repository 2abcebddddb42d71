"""Smoke test of the engine benchmark: ``python -m ftsdp.tools.bench_engine`` at the tiniest size, 2 steps,
world size 2, with ``--compile`` (backend ``aot_eager``: Dynamo and AOTAutograd capture the forward and
backward graphs as for Inductor, which are then run eagerly, without Inductor's kernel generation: ~25 s
on a cold cache); it must print its tables and one MET / MISSED line per target, and write its section of
the Markdown file without touching anyone else's."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = [
    *["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64"],
    *["--block-size", "16", "--batch", "2", "--seq", "8", "--steps", "2", "--warmup", "1"],
    *["--world-sizes", "2", "--cuda", "off", "--compile", "--compile-backend", "aot_eager"],
]
OTHERS = "# Benchmarks\n\n## Checkpoint\n\ntheir table\n\n## Checkpoint: notes\n\ntheir notes\n"


@pytest.mark.timeout(240)
def test_tiny_run_prints_tables_and_verdicts_and_writes_only_its_section(tmp_path) -> None:
    out = tmp_path / "benchmarks.md"
    out.write_text(OTHERS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    results = ["--json", str(tmp_path / "benchmarks.json")]
    proc = subprocess.run(
        [sys.executable, "-m", "ftsdp.tools.bench_engine", *TINY, "--out", str(out), *results],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    stdout = proc.stdout
    for engine in ("ftsdp", "fsdp2", "ddp"):
        assert re.search(rf"^\| W=2 CPU/gloo \| {engine} \| [\d.]+ \|", stdout, re.M), stdout
    for target in (
        "step time ftsdp / FSDP2 <= 1.0",
        "bytes communicated = theory within padding",
        "peak params + grads + AdamW per rank",
    ):
        assert re.search(
            rf"^- W=2 CPU/gloo {re.escape(target)}.*: (MET|MISSED) \(", stdout, re.M
        ), (
            target,
            stdout,
        )
    assert "load average" in stdout
    # --compile: both engines again, the whole model compiled, beside their eager step times
    assert "torch.compile of the whole model (backend aot_eager)" in stdout, stdout
    for engine in ("ftsdp", "fsdp2"):
        row = rf"^\| W=2 CPU/gloo \| {engine} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$"
        assert re.search(row, stdout, re.M), stdout
    # The ring-cost bytes are exact at this size (no padding): FULL_SHARD less the root's re-gather.
    assert "bytes communicated = theory within padding: MET" in stdout, stdout

    text = out.read_text()
    assert text.startswith(OTHERS.rstrip("\n")), text[:400]  # their sections, untouched
    assert text.count("## Engine") == 1
    assert "`python -m ftsdp.tools.bench_engine " in text and "--out " in text
    assert "| W=2 CPU/gloo | ftsdp |" in text

    # The JSON entry (ftsdp-report --bench) holds the tables' numbers.
    (run,) = json.loads((tmp_path / "benchmarks.json").read_text())["engine"]["runs"]
    # the tables' order; --compile adds the compiled engines last
    assert list(run["engines"]) == ["ftsdp", "fsdp2", "ddp", "ftsdp-compiled", "fsdp2-compiled"]
    for engine, v in run["engines"].items():
        assert f"| W=2 CPU/gloo | {engine} | {v['step_ms']:.1f} |" in text, engine
        peak = v["memory"]["peak_fwd_bwd"]
        assert re.search(
            rf"^\| W=2 CPU/gloo \| {engine} \| [^|]+ \| {peak / 1e6:.2f} \|", text, re.M
        )
        held = v["memory"]["params"] + v["memory"]["optim"]
        assert held <= v["memory"]["start"] <= peak


def test_write_section_replaces_only_its_own_section(tmp_path) -> None:
    from ftsdp.tools._bench_engine_report import write_section

    path = tmp_path / "b.md"
    path.write_text(OTHERS)
    write_section(str(path), "## Engine\n\nfirst\n")
    path.write_text(path.read_text() + "\n## Later\n\nsomeone else's\n")
    write_section(str(path), "## Engine\n\nsecond\n")
    text = path.read_text()
    assert text.startswith(OTHERS.rstrip("\n"))
    assert "first" not in text and text.count("## Engine") == 1
    assert text.index("second") < text.index("## Later") and "someone else's" in text
