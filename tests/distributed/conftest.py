"""Rank-group spawns shared by several modules of this folder: a spawn costs seconds (every rank
imports torch), so modules that need ranks of the same world size share one.

``checkpoint_spawns`` (session-scoped): CheckpointManager saved at world size 2 and resumed at 3,
for ``test_checkpoint_manager.py`` and ``test_checkpoint_manager_engines.py``. One W=2 spawn runs
both modules' save phases and the first module's follow-ups (its saved run copied with step 5
corrupted), then one W=3 spawn runs both modules' resume phases: two spawns where there were
five. The phases run one after the other in the same processes; each phase's result (or its
traceback) is kept apart, so a phase that fails fails only the tests that use it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest

from ftsdp.testing import run_ranks

Phase = tuple[Callable[..., Any], tuple[Any, ...]]


def in_turn(rank: int, world: int, phases: list[Phase]) -> list[tuple[bool, Any]]:
    """Rank function: ``fn(rank, world, *args)`` for every ``(fn, args)`` of ``phases``, in
    order; per phase ``(True, result)``, or ``(False, traceback)`` if it raised."""
    out: list[tuple[bool, Any]] = []
    for fn, args in phases:
        try:
            out.append((True, fn(rank, world, *args)))
        except Exception:
            out.append((False, traceback.format_exc()))
    return out


def phase_results(per_rank: list[list[tuple[bool, Any]]], index: int) -> list[Any]:
    """The results of phase ``index`` on every rank, in rank order; a failed phase raises
    ``RuntimeError`` with the traceback of every rank it failed on."""
    failed = [(r, res[index][1]) for r, res in enumerate(per_rank) if not res[index][0]]
    if failed:
        raise RuntimeError(
            f"phase {index} failed on rank(s) {[r for r, _ in failed]}:\n\n"
            + "\n\n".join(f"rank {r}:\n{tb}" for r, tb in failed)
        )
    return [res[index][1] for res in per_rank]


class CheckpointSpawns:
    """What the two spawns left, per module; each accessor raises if its phases failed."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        from tests.distributed import test_checkpoint_manager as manager
        from tests.distributed import test_checkpoint_manager_engines as engines

        self.url = str(tmp_path_factory.mktemp("ckpt") / "run")
        self.corrupt = tmp_path_factory.mktemp("fallback") / "run"
        self.again = str(tmp_path_factory.mktemp("again") / "again")
        self.root = tmp_path_factory.mktemp("engines")
        self.w2 = run_ranks(
            in_turn,
            2,
            [
                (manager._save_phase, (self.url,)),
                (manager._corrupt_copy_phase, (self.url, str(self.corrupt))),
                (manager._followups, (self.url, str(self.corrupt))),
                (engines._save_grid, (str(self.root),)),
            ],
        )
        self.damaged: Any = None  # between the saves and the resumes: the engines' fallback
        try:
            self.damaged = engines._damage_and_keep(self.root)
        except Exception as e:
            self.damaged = e
        self.w3 = run_ranks(
            in_turn,
            3,
            [
                (manager._resume_phase, (self.url, self.again)),
                (engines._resume_grid, (str(self.root),)),
            ],
        )

    # test_checkpoint_manager.py
    def saved(self) -> tuple[str, dict]:
        """The W=2 run's URL and rank 0's record of it."""
        return self.url, phase_results(self.w2, 0)[0]

    def followups(self) -> tuple[Any, list[dict]]:
        """The corrupted copy and every rank's follow-up results."""
        phase_results(self.w2, 1)
        return self.corrupt, phase_results(self.w2, 2)

    def resumed_at_3(self) -> tuple[str, dict]:
        """Where the W=3 resume saved step 5 again, and rank 0's record of it."""
        return self.again, phase_results(self.w3, 0)[0]

    # test_checkpoint_manager_engines.py
    def engine_runs(self) -> tuple[Any, Any, dict, dict, Any]:
        """The grid's root, its copy as saved, rank 0's saved and resumed records, and the
        original step 3 of fsdp2-adamw (before it was corrupted)."""
        saved = phase_results(self.w2, 3)[0]
        if isinstance(self.damaged, Exception):
            raise self.damaged
        as_saved, original_3 = self.damaged
        return self.root, as_saved, saved, phase_results(self.w3, 1)[0], original_3


@pytest.fixture(scope="session")
def checkpoint_spawns(tmp_path_factory: pytest.TempPathFactory) -> CheckpointSpawns:
    """Both CheckpointManager modules' W=2 and W=3 phases, one spawn per world size (see the
    module docstring)."""
    return CheckpointSpawns(tmp_path_factory)
