"""The hf, torch and dcp sources of ``ftsdp-ckpt inspect`` and ``convert`` against random damage
and hostile structure (issue 29, item 6): every command exits 0 or 2 with one line, never 3, and
``convert --to ftsdp`` commits only steps that ``inspect`` and ``verify`` accept (see
``tools/dev/fuzz_sources.py`` for the mutations and the oracle). Longer runs:
``python -m ftsdp.tools.dev.fuzz_sources --cases 3000 --seed N``."""

from __future__ import annotations

import os
import pathlib

import pytest

from ftsdp.tools.dev.fuzz_sources import FORMATS, describe, run

CASES = int(os.environ.get("FTSDP_FUZZ_SOURCE_CASES", "160"))
SEED = int(os.environ.get("FTSDP_FUZZ_SEED", "2024"))


@pytest.mark.timeout(300)
def test_hostile_sources_exit_0_or_2_and_commit_only_readable_steps(
    tmp_path: pathlib.Path,
) -> None:
    summary = run(CASES, SEED, workdir=str(tmp_path))
    failures = summary.failures
    assert not failures, (
        f"{len(failures)} of {len(summary.cases)} cases broke the oracle:\n\n"
        + "\n\n".join(describe(c, SEED) for c in failures[:10])
        + f"\n\n{summary.table()}"
    )
    # Every source format was both read and refused, by each kind of damage it has.
    for fmt in FORMATS:
        outcomes = {c.outcome.split()[2] for c in summary.cases if c.fmt == fmt}
        assert {"ftsdp:0", "ftsdp:2"} <= outcomes, (fmt, summary.table())
    kinds = {(c.fmt, c.kind) for c in summary.cases}
    assert {
        ("hf", "header"), ("hf", "values"), ("hf-index", "index"), ("torch", "state"),
        ("dcp", "state"), ("dcp", "flip"), ("torch", "truncate"),
    } <= kinds  # fmt: skip
