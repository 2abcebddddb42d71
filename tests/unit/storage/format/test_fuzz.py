"""The reader against random damage (docs/format.md, "Threat model"): mutations of a small
checkpoint, each loaded with ``load``, ``load_state_dict`` and checked with ``verify`` and
``ftsdp-ckpt verify``. Each must return exactly the saved values or raise a ``CheckpointError``
(see ``tools/dev/fuzz_checkpoint.py`` for the mutations and the oracle).

A short run here, long ones outside the suite: ``python -m ftsdp.tools.dev.fuzz_checkpoint
--cases 20000 --seed N`` (``--sharded``, ``--grid`` for the other two checkpoints), or this file
with ``FTSDP_FUZZ_CASES=1000`` (``FTSDP_FUZZ_SEED`` for another seed).

Why 200 cases (150 for the sharded and grid checkpoints; it was 1,000, 250 and 150): a case's
mutation kind is drawn first from its own seeded generator, the same for every checkpoint, and
seed 2024's first 138 cases already hold every one of the 27 kinds (20 mutations, the 7 manifest
edits also resealed); the tests assert that every kind ran, so a changed mutator or seed that
needs more cases fails here instead of silently testing less. The first 200 plain cases reach
47 of the 58 pairs of kind and outcome that 1,000 reach, with every outcome, 41 of them resealed
manifest edits; 150 sharded cases reach 46 of 52 pairs, 150 grid cases all 37.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from ftsdp.tools.dev.fuzz_checkpoint import Summary, describe, run

CASES = int(os.environ.get("FTSDP_FUZZ_CASES", "200"))
SEED = int(os.environ.get("FTSDP_FUZZ_SEED", "2024"))
SHORTER = CASES * 3 // 4  # the sharded and grid checkpoints: their cases cost more

EDITS = ["value", "delete", "rename", "dtype", "object", "swap", "add"]
FILES = ["remove", "rename", "swap", "extra", "dir", "step", "torn", "copy"]
# Every kind of damage the mutator does (``Mutator``: its methods, their edits, resealed or not).
KINDS = {
    "bit flip", "truncate", "append", "json text", "link",
    *(f"json {e}" for e in EDITS), *(f"json {e} (resealed)" for e in EDITS),
    *(f"file {f}" for f in FILES),
}  # fmt: skip


def _check(summary: Summary, resealed: int, outcomes: set[str]) -> None:
    """No case broke the oracle; every kind of damage ran; the outcomes were reached."""
    failures = summary.failures
    assert not failures, (
        f"{len(failures)} of {len(summary.cases)} mutations broke the oracle:\n\n"
        + "\n\n".join(describe(c, SEED) for c in failures[:10])
        + f"\n\n{summary.table()}"
    )
    kinds = {c.kind for c in summary.cases}
    assert kinds == KINDS, (
        f"kinds missing {sorted(KINDS - kinds)} (more cases?), unknown {sorted(kinds - KINDS)}"
    )
    words = {w for c in summary.cases for w in c.outcome.split()}
    assert outcomes <= words, (sorted(outcomes - words), summary.table())
    assert sum("(resealed)" in c.kind for c in summary.cases) > resealed  # past the checksum


@pytest.mark.timeout(300)
def test_every_mutation_loads_exactly_or_raises_a_checkpoint_error(tmp_path: pathlib.Path) -> None:
    summary = run(CASES, SEED, workdir=str(tmp_path))
    print(summary.table())
    # The mutations reach every part of the reader: loads both succeeded (damage that does not
    # matter: ``latest``, an extra file, a link to an identical copy) and failed with each of the
    # errors a reader raises for a damaged checkpoint.
    outcomes = {
        "exact",
        "CorruptCheckpointError",
        "IncompleteCheckpointError",
        "CheckpointNotFoundError",
        "verify:ok",
        "verify:problems",
    }
    _check(summary, CASES // 7, outcomes)
    assert len(summary.cases) == CASES


@pytest.mark.timeout(300)
def test_a_sharded_version_4_checkpoint_under_the_same_damage(tmp_path: pathlib.Path) -> None:
    """The same oracle on a checkpoint saved by 3 ranks whose tensors are described by layout
    rules (format version 4): a reader derives each rank's pieces, so damage to the rule table,
    the per-rank object counts or the packed checksums must end in a CheckpointError too."""
    summary = run(SHORTER, SEED, workdir=str(tmp_path), sharded=True)
    _check(summary, 20, {"exact", "CorruptCheckpointError", "IncompleteCheckpointError"})


@pytest.mark.timeout(300)
def test_a_version_5_checkpoint_on_a_grid_under_the_same_damage(tmp_path: pathlib.Path) -> None:
    """The same oracle on the checked-in version 5 golden (4 ranks on a 2 x 2 mesh: 2-D and 3-D
    boxes, a layout rule on a grid), copied: damage to a grid must end in a CheckpointError too
    (1,500 cases of seed 0 ran clean: ``python -m ftsdp.tools.dev.fuzz_checkpoint --grid
    --cases 1500``)."""
    summary = run(SHORTER, SEED, workdir=str(tmp_path), grid=True)
    _check(summary, 10, {"exact", "CorruptCheckpointError", "IncompleteCheckpointError"})
