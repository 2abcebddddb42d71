"""The snapshot benchmark's rounds (``python -m ftsdp.tools.bench_snapshot``): every save has
``--every`` steps of training inside the timed round, as in a long run."""

from __future__ import annotations

import time
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


def test_overhead_pairs_each_round_with_the_unsaved_one() -> None:
    """A machine that slows down in one round slows every configuration of that round: the
    overhead is the median of the per-round ratios, each round against the unsaved round
    right before it (``pairs``), not a ratio of medians."""
    times = {
        "ftsdp/none": [1.0, 5.0, 2.0, 1.0],  # its second round paired with nothing
        "ftsdp/storage": [1.1, 2.2, 1.3],  # +10%, +10%, +30%: median +10%
        "fsdp2/none": [1.0, 1.0, 1.0],
        "fsdp2/dcp": [1.5, 1.5, 1.5],
    }
    pairs = {"ftsdp/storage": [0, 2, 3]}
    ranks = [
        {
            k: {"times": v, "blocking": [0.01, 0.02], "fence": [], "pairs": pairs.get(k)}
            for k, v in times.items()
        }
        for _ in range(2)
    ]
    rows = bench_snapshot.summarize(ranks)
    assert rows["ftsdp/storage"]["overhead"] == pytest.approx(0.1)  # medians' ratio: +30%
    # the middle half of the per-round overheads (+10%, +10%, +30%)
    assert rows["ftsdp/storage"]["overhead_q1"] == pytest.approx(0.1)
    assert rows["ftsdp/storage"]["overhead_q3"] == pytest.approx(0.2)
    assert rows["ftsdp/storage"]["step_s"] == pytest.approx(1.3)
    assert rows["fsdp2/dcp"]["overhead"] == pytest.approx(0.5)
    assert rows["ftsdp/none"]["overhead"] == 0


def test_the_busy_rank_bench_runs_its_python_work_inside_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``bench_busy_rank``: each would-be save starts a thread burning that much CPU in Python,
    and the round ends only once every such thread has finished."""
    from ftsdp.tools import bench_busy_rank

    monkeypatch.setattr(bench_snapshot, "dist", types.SimpleNamespace(barrier=lambda: None))
    run: Any = bench_busy_rank._Busy.__new__(bench_busy_rank._Busy)
    run.cfg, run.step, run.times, run.mode = {"steps": 4, "every": 2}, 0, [], "none"
    run.seconds, run.threads = 0.02, []
    run.train_step = lambda: setattr(run, "step", run.step + 1)
    run.prune_dcp = lambda: None
    cpu = time.process_time()
    run.round()
    assert time.process_time() - cpu >= 2 * 0.02  # two would-be saves (at 0 and after step 2)
    assert run.threads == [] and len(run.times) == 1


def test_only_runs_the_named_saving_configurations_with_their_unsaved_rounds() -> None:
    assert bench_snapshot.configs(None) == list(bench_snapshot.CONFIGS)
    assert bench_snapshot.configs(["ftsdp/storage"]) == [("ftsdp", "none"), ("ftsdp", "storage")]
    picked = bench_snapshot.configs(["fsdp2/dcp", "ftsdp/memory"])
    assert picked == [("ftsdp", "none"), ("ftsdp", "memory"), ("fsdp2", "none"), ("fsdp2", "dcp")]
    with pytest.raises(SystemExit, match="ftsdp/none"):
        bench_snapshot.configs(["ftsdp/none"])
    # with only some rows, the verdicts that need the others are left out
    row = {"overhead": 0.04, "first_blocking_s": None, "later_blocking_s": None}
    assert bench_snapshot.verdicts({"ftsdp/storage": row}, 2) == [
        "- saving every 2 steps adds <= 5% to ftsdp's step: MET (+4.0%)"
    ]


def test_an_unknown_configuration_is_refused_before_anything_is_made(tmp_path: Any) -> None:
    with pytest.raises(SystemExit, match="ftsdp/nope"):
        bench_snapshot.main(["--only", "ftsdp/nope", "--dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_save_cpu_reads_each_threads_cpu_and_tables_what_saving_adds() -> None:
    """``bench_save_cpu``: a thread that burns CPU shows it under its own name, the one that
    read nothing in between shows none, and the table gives per rank what each thread used
    more per step and per save, beside the wall time."""
    import threading

    from ftsdp.tools import bench_busy_rank, bench_save_cpu

    done = threading.Event()

    def work() -> None:  # burn, then stay alive until read (an ended thread leaves /proc)
        bench_busy_rank.burn(0.05)
        done.wait(30)

    before = bench_save_cpu.thread_cpu()
    t = threading.Thread(target=work, name="storage-save-7")
    t.start()
    during: dict[str, float] = {}
    deadline = time.monotonic() + 10
    while during.get("storage-save", 0.0) < 0.02 and time.monotonic() < deadline:
        time.sleep(0.05)  # (the kernel counts in ticks of 10 ms)
        during = bench_save_cpu.added(before, bench_save_cpu.thread_cpu())
    done.set()
    t.join()
    assert during.get("storage-save", 0.0) >= 0.02  # the per-save suffix is dropped
    assert "storage-save-7" not in during

    rank = {
        "cpu": {
            "none": {"process": 0.180, "MainThread": 0.160, "native:gloo": 0.013},
            "storage": {"process": 0.192, "MainThread": 0.163, "storage-save": 0.004},
        },
        "wall": {"none": 0.200, "storage": 0.210},
    }
    text = bench_save_cpu.table([rank, rank], "cmd", 2)
    assert "| 0 | the whole process | 180.0 | 192.0 | +12.0 | +24.0 |" in text
    assert "| 1 | storage-save | 0.0 | 4.0 | +4.0 | +8.0 |" in text
    assert "| 0 | wall time, barrier to barrier | 200.0 | 210.0 | +10.0 | +20.0 |" in text


@pytest.mark.timeout(300)
def test_the_saving_configurations_run_end_to_end(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A smoke run of the real loop (two gloo ranks) through CheckpointManager's durable and
    memory tiers: every saving round saved, blocked a positive time and committed."""
    from ftsdp.tools import bench_snapshot

    args = ["--only", "ftsdp/storage,ftsdp/memory", "--rounds", "1", "--steps", "4"]
    bench_snapshot.main([*args, "--warmup", "0", "--dir", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if "CheckpointManager" in line]
    assert len(lines) == 2, lines
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[5]) > 0 and float(cells[6]) > 0, line  # blocking, first and later
        assert int(cells[-1]) == 2, line  # saves: every 2 steps of 4
