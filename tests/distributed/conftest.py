"""Rank groups shared by the modules of this folder: one spawn per world size.

A spawn costs seconds (every rank imports torch and joins a process group: 5-9 s for a group
of 2-4 on the 2 loaded cores; the groups fork from ``run_ranks``' fork server, which imported
torch once), so the modules below do not spawn their own groups: the session
fixture ``spawns`` runs, at its first use for a world size, one group of that size in which
every *phase* of the selected modules runs in turn (``in_turn``), and keeps each phase's result
per rank. A phase that raises fails only the tests that use it (``phase_results`` raises its
traceback); a phase that hangs or kills its rank fails every test of that spawn.

- W=2: ``test_checkpoint_manager.py`` (save, corrupt copy, follow-ups),
  ``test_checkpoint_manager_engines.py`` (the save grid), ``test_engine_streams.py``,
  ``test_engine_grad_scaler.py``, ``test_engine_parity.py``,
  ``test_engine_mixed_precision_fsdp2.py``, ``test_engine_compile.py``,
  ``test_engine_fsdp1_compat.py``;
- W=3: the two CheckpointManager modules' resumes (after the W=2 spawn, and after
  ``_damage_and_keep`` between the two), ``test_engine_behaviour.py``,
  ``test_engine_parity.py``, ``test_engine_mixed_precision_fsdp2.py``,
  ``test_engine_compile.py``;
- W=4: ``test_engine_features.py`` first (its memory checks read this process's RSS), then
  ``test_engine_edge_cases.py``, ``test_engine_parity.py``, ``test_engine_compile.py`` and
  ``test_checkpoint_manager.py``'s memory tier on two simulated nodes.

``test_nd_layouts.py`` saves in the W=4 spawn (after every other phase) and loads and resumes in
the W=2 and W=3 spawns, so when it is selected the W=4 spawn runs before the other two.

Only the phases of modules that have a selected test run, so running one module alone still
costs one spawn per world size it uses.
"""

from __future__ import annotations

import importlib
import pathlib
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from ftsdp.testing import run_ranks

Phase = tuple[Callable[..., Any], tuple[Any, ...]]
PKG = "tests.distributed."
# world size -> (module, rank function) of the engine modules' phases, in the order they run
ENGINE_PHASES: dict[int, list[tuple[str, str]]] = {
    2: [
        ("test_engine_streams", "rank_main"),
        ("test_engine_grad_scaler", "rank_main"),
        ("test_engine_parity", "parity_grid"),
        ("test_engine_mixed_precision_fsdp2", "mixed_precision"),
        ("test_engine_compile", "compile_grid"),
        ("test_engine_fsdp1_compat", "rank_main"),  # last: it runs torch FSDP1 too
        ("test_engine_fsdp1_compat", "in_parent"),
    ],
    3: [
        ("test_engine_behaviour", "behaviour"),
        ("test_engine_parity", "parity_grid"),
        ("test_engine_mixed_precision_fsdp2", "mixed_precision"),
        ("test_engine_compile", "compile_grid"),
    ],
    4: [
        ("test_engine_features", "features"),
        ("test_engine_edge_cases", "edge_cases"),
        ("test_engine_parity", "parity_grid"),
        ("test_engine_compile", "compile_grid"),
    ],
}
# test_nd_layouts.py: world size -> the (dp, tp) mesh its loads and resume run at
ND_LOADS = {3: (3, 1), 2: (1, 2)}
TIMEOUT_S = 600  # a whole spawn, every phase of it


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


class SharedSpawns:
    """The spawns of this folder (see the module docstring) and what their phases returned."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, modules: set[str]) -> None:
        self.modules = modules  # short names of the modules with a selected test
        self.checkpoints = bool(
            {"test_checkpoint_manager", "test_checkpoint_manager_engines"} & modules
        )
        if self.checkpoints:
            self.url = str(tmp_path_factory.mktemp("ckpt") / "run")
            self.corrupt = tmp_path_factory.mktemp("fallback") / "run"
            self.again = str(tmp_path_factory.mktemp("again") / "again")
            self.root = tmp_path_factory.mktemp("engines")
            self.nodes = tmp_path_factory.mktemp("nodes")
        if "test_nd_layouts" in modules:
            self.nd_root = str(tmp_path_factory.mktemp("nd"))
        self.damaged: Any = None
        self._names: dict[int, list[str]] = {}  # per world size, the phase names in order
        self._results: dict[int, list[list[tuple[bool, Any]]]] = {}

    def _phases(self, world: int) -> list[tuple[str, Phase]]:
        from tests.distributed import test_checkpoint_manager as manager
        from tests.distributed import test_checkpoint_manager_engines as engines

        phases: list[tuple[str, Phase]] = []
        if self.checkpoints and world == 2:
            phases += [
                ("manager.save", (manager._save_phase, (self.url,))),
                ("manager.corrupt", (manager._corrupt_copy_phase, (self.url, str(self.corrupt)))),
                ("manager.followups", (manager._followups, (self.url, str(self.corrupt)))),
                ("engines.save", (engines._save_grid, (str(self.root),))),
            ]
        if self.checkpoints and world == 3:
            phases += [
                ("manager.resume", (manager._resume_phase, (self.url, self.again))),
                ("engines.resume", (engines._resume_grid, (str(self.root),))),
            ]
        for module, fn in ENGINE_PHASES.get(world, []):
            if module in self.modules:
                target = getattr(importlib.import_module(PKG + module), fn)
                phases.append((f"{module}.{fn}", (target, ())))
        if self.checkpoints and world == 4:  # after test_engine_features' memory checks
            phases.append(("manager.node_memory", (manager._node_memory_phase, (str(self.nodes),))))
        if "test_nd_layouts" in self.modules:
            from tests.distributed import test_nd_layouts as nd

            if world == 4:
                phases.append(("nd.saves", (nd._saves, (self.nd_root,))))
            elif world in ND_LOADS:
                phases.append(("nd.loads", (nd._loads, (self.nd_root, *ND_LOADS[world]))))
        return phases

    def _spawn(self, world: int) -> None:
        if world in self._results:
            return
        if world in ND_LOADS and "test_nd_layouts" in self.modules:
            self._spawn(4)  # its loads read what its W=4 phase saved
        if world == 3 and self.checkpoints:  # the resumes read what the W=2 saves wrote
            self._spawn(2)
            from tests.distributed import test_checkpoint_manager_engines as engines

            try:
                self.damaged = engines._damage_and_keep(self.root)
            except Exception as e:  # raised by engine_runs()
                self.damaged = e
        phases = self._phases(world)
        self._names[world] = [name for name, _ in phases]
        self._results[world] = run_ranks(
            in_turn, world, [p for _, p in phases], timeout=TIMEOUT_S, start_method="forkserver"
        )

    def result(self, world: int, name: str) -> list[Any]:
        """Every rank's result of phase ``name`` of the W=``world`` spawn (run at first use)."""
        self._spawn(world)
        return phase_results(self._results[world], self._names[world].index(name))

    # test_checkpoint_manager.py
    def saved(self) -> tuple[str, dict]:
        """The W=2 run's URL and rank 0's record of it."""
        return self.url, self.result(2, "manager.save")[0]

    def followups(self) -> tuple[pathlib.Path, list[dict]]:
        """The corrupted copy and every rank's follow-up results."""
        self.result(2, "manager.corrupt")
        return self.corrupt, self.result(2, "manager.followups")

    def resumed_at_3(self) -> tuple[str, dict]:
        """Where the W=3 resume saved step 5 again, and rank 0's record of it."""
        return self.again, self.result(3, "manager.resume")[0]

    # test_checkpoint_manager_engines.py
    def engine_runs(self) -> tuple[Any, Any, dict, dict, Any]:
        """The grid's root, its copy as saved, rank 0's saved and resumed records, and the
        original step 3 of fsdp2-adamw (before it was corrupted)."""
        saved = self.result(2, "engines.save")[0]
        resumed = self.result(3, "engines.resume")[0]
        if isinstance(self.damaged, Exception):
            raise self.damaged
        as_saved, original_3 = self.damaged
        return self.root, as_saved, saved, resumed, original_3

    # test_nd_layouts.py
    def nd(self, world: int) -> list[Any]:
        """Every rank's result of the N-D module's phase at ``world`` (4: the saves)."""
        return self.result(world, "nd.saves" if world == 4 else "nd.loads")


@pytest.fixture(scope="session")
def spawns(request: pytest.FixtureRequest, tmp_path_factory) -> SharedSpawns:
    """This folder's shared spawns (see the module docstring)."""
    modules = {
        item.module.__name__.rpartition(".")[2]
        for item in request.session.items
        if getattr(item, "module", None) is not None
    }
    return SharedSpawns(tmp_path_factory, modules)
