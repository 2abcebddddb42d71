"""The snapshot benchmark's rounds (``python -m ftsdp.tools.bench_snapshot``): every save has
``--every`` steps of training inside the timed round, as in a long run."""

from __future__ import annotations

import types
from typing import Any

import pytest

from ftsdp.tools import bench_snapshot


@pytest.mark.parametrize(("steps", "every"), [(8, 2), (6, 3), (4, 1)])
def test_each_save_is_followed_by_every_steps_inside_the_round(
    monkeypatch: pytest.MonkeyPatch, steps: int, every: int
) -> None:
    events: list[Any] = []
    monkeypatch.setattr(bench_snapshot, "dist", types.SimpleNamespace(barrier=lambda: None))
    run: Any = bench_snapshot._Run.__new__(bench_snapshot._Run)
    run.cfg, run.step, run.times, run.mode = {"steps": steps, "every": every}, 2, [], "storage"
    run.train_step = lambda: (setattr(run, "step", run.step + 1), events.append(run.step))
    run.save = lambda: events.append(f"save {run.step}")
    run.finish_saves = lambda: events.append("wait")
    for _ in range(2):
        run.round()
    saves = [i for i, e in enumerate(events) if isinstance(e, str) and e.startswith("save")]
    assert len(saves) == 2 * steps // every  # the schedule's number of saves
    for i in saves:  # the saved step, then `every` steps before the next save or the round's end
        saved = int(events[i].split()[1])
        assert events[i + 1 : i + 1 + every] == [saved + k for k in range(1, every + 1)]
    # no step is saved twice, and each round waits for its saves once, at its end
    named = [e for e in events if isinstance(e, str) and e.startswith("save")]
    assert len(set(named)) == len(named) and events.count("wait") == 2 and events[-1] == "wait"
    assert len(run.times) == 2
