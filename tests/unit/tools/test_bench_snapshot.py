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
    run.saver = bench_snapshot._Saver(run)
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
            k: {
                "times": v,
                "blocking": [0.01, 0.02],
                "fence": [],
                "copy": [],
                "pairs": pairs.get(k),
            }
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
    run.saver = bench_snapshot._Saver(run)
    cpu = time.process_time()
    run.round()
    assert time.process_time() - cpu >= 2 * 0.02  # two would-be saves (at 0 and after step 2)
    assert run.threads == [] and len(run.times) == 1


def test_only_runs_the_named_saving_configurations_with_their_unsaved_rounds() -> None:
    assert bench_snapshot.configs(None) == list(bench_snapshot.CONFIGS)
    # a bare mode names it on every engine that has it
    assert bench_snapshot.configs(["floor", "storage", "dcp", "dcp-process"]) == [
        ("ftsdp", "none"),
        ("ftsdp", "floor"),
        ("ftsdp", "storage"),
        ("fsdp2", "none"),
        ("fsdp2", "dcp"),
        ("fsdp2", "dcp-process"),
        ("fsdp2", "storage"),
    ]
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
    memory tiers, its persister, and the floor: every saving round saved, blocked a positive
    time and committed; the floor's copies took a positive time, and the rows are set against
    it. A GPT of 2 blocks of 32 on 2 x 16-token sequences: the loop's steps cost milliseconds,
    and the saves still hold several units' flat shards and their AdamW state."""
    from ftsdp.tools import bench_snapshot

    only = "ftsdp/storage,ftsdp/memory,ftsdp/persister,floor"
    args = ["--only", only, "--rounds", "1", "--steps", "4", "--warmup", "1"]
    args += ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--vocab-size", "64"]
    args += ["--block-size", "16", "--micro-batch", "2"]
    bench_snapshot.main([*args, "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "CheckpointManager" in line or "floor" in line]
    lines = [line for line in lines if line.startswith("| ftsdp")]
    assert len(lines) == 4, out
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[6]) > 0 and float(cells[7]) > 0, line  # blocking, first and later
        assert int(cells[-1]) == 2, line  # saves: every 2 steps of 4
        assert cells[5] == "n/a" or cells[5].endswith("x"), line  # overhead / floor
        # copy ms: the floor's alone
        assert float(cells[9]) > 0 if "floor" in cells[1] else cells[9] == "-", line


def _floor_and_dcp_process(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One floor save and one ``dcp-process`` save of the MLP, each followed by a step; what
    they hold against the state at the save, and whether DCP's process has ended."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _async_process_executor as ape
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    run = bench_snapshot._Run("ftsdp", "floor", cfg, cfg["root"])
    floor = run.saver
    assert isinstance(floor, bench_snapshot._Floor)
    at_save = [t.clone() for t in floor.sources]
    run.save()
    run.train_step()  # waits for the copy before it changes the state
    run.finish_saves()
    out["floor_copied"] = all(
        torch.equal(b, s) for b, s in zip(floor.buffers, at_save, strict=True)
    )
    out["floor_stepped"] = not all(
        torch.equal(b, s) for b, s in zip(floor.buffers, floor.sources, strict=True)
    )
    out["floor_bytes"] = sum(t.numel() * t.element_size() for t in floor.buffers)
    # the reference: this rank's parameter slices and the optimizer's own state
    out["state_bytes"] = sum(p.numel() * p.element_size() for p in run.model.parameters()) + sum(
        v.numel() * v.element_size()
        for entry in run.opt.state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor)
    )
    out["floor_saves"] = (len(floor.blocking), len(floor.copy), len(floor.fence))
    floor.close()

    run = bench_snapshot._Run("fsdp2", "dcp-process", cfg, cfg["root"])
    model_sd, optim_sd = get_state_dict(run.model, run.opt)
    expected = {k: v.full_tensor().clone() for k, v in model_sd.items()}
    run.save()
    run.train_step()
    run.finish_saves()
    process = ape._CHECKPOINT_PROCESS._save_process  # type: ignore[union-attr]
    model_sd, optim_sd = get_state_dict(run.model, run.opt)  # the step's values
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{run.url}/step-{run.step - 1}")
    out["dcp_loaded"] = all(torch.equal(v.full_tensor(), expected[k]) for k, v in model_sd.items())
    run.saver.close()
    out["dcp_process_ended"] = not process.is_alive() and ape._CHECKPOINT_PROCESS is None
    return out


@pytest.mark.timeout(300)
def test_the_floor_copies_the_state_and_dcp_process_saves_it(tmp_path: Any) -> None:
    """The floor copies every byte of the rank's state (its parameter shards and AdamW state),
    the values at the save although the next step follows at once; DCP's process mode saves the
    state of its save (read back with ``dcp.load``) on gloo, and its process ends at close."""
    from ftsdp.testing import run_ranks

    cfg = {
        "workload": "mlp",
        "mlp_batch": 2,
        "model": {},
        "seed": 0,
        "every": 2,
        "steps": 2,
        "warmup": 1,
        "micro_steps": 1,
        "root": str(tmp_path),
    }
    for out in run_ranks(_floor_and_dcp_process, 2, cfg, timeout=240):
        assert out["floor_copied"] and out["floor_stepped"], out
        # 8 x (1024 x 1024 + 1024) fp32 parameters, AdamW's two moments, halved; and 16 steps
        assert out["floor_bytes"] == out["state_bytes"] == 8 * 1049600 * 4 * 3 // 2 + 16 * 4
        assert out["floor_saves"] == (1, 1, 1), out
        assert out["dcp_loaded"] and out["dcp_process_ended"], out


def _ranks(overheads: dict[str, float], floor_copies: list[list[float]]) -> list[dict[str, Any]]:
    """Two ranks' results of one round per configuration, each unsaved round at 1 s, the later
    saves blocking 2 ms, the floor's copies per rank as given."""
    times = {"ftsdp/none": [1.0], "fsdp2/none": [1.0]}
    times.update({k: [1.0 + v] for k, v in overheads.items()})
    return [
        {
            k: {
                "times": v,
                "blocking": [0.01, 0.002, 0.002],
                "fence": [],
                "copy": copies if k == "ftsdp/floor" else [],
                "pairs": None,
            }
            for k, v in times.items()
        }
        for copies in floor_copies
    ]


def test_each_saving_row_is_set_against_the_floor_and_the_better_dcp_mode() -> None:
    """The floor's copy is the slowest rank's per save, median; every saving row's overhead is
    divided by the floor's; the targeted row's verdicts compare it with 2x the floor's, 0.25x
    the better DCP mode's, and its later saves' blocking with the floor's copy + 1 ms."""
    overheads = {
        "ftsdp/floor": 0.02,
        "ftsdp/storage": 0.03,
        "fsdp2/dcp": 0.40,
        "fsdp2/dcp-process": 0.10,
    }
    # slowest rank per save: 5, 6 and 8 ms; median 6 (either rank's own median is 5)
    rows = bench_snapshot.summarize(
        _ranks(overheads, [[0.004, 0.006, 0.005], [0.005, 0.003, 0.008]])
    )
    assert rows["ftsdp/floor"]["copy_s"] == pytest.approx(0.006)
    assert rows["ftsdp/storage"]["copy_s"] is None
    assert rows["ftsdp/storage"]["overhead_per_floor"] == pytest.approx(1.5)
    assert rows["fsdp2/dcp"]["overhead_per_floor"] == pytest.approx(20.0)
    assert rows["ftsdp/floor"]["overhead_per_floor"] == pytest.approx(1.0)
    assert rows["ftsdp/none"]["overhead_per_floor"] is None

    lines = bench_snapshot.floor_verdicts(rows, "ftsdp/storage")
    assert len(lines) == 3, lines
    assert lines[0].endswith("MET (1.50x: +3.0% against +2.0%)"), lines
    # +3% > 0.25 x +10% (dcp-process, the better of the two modes)
    assert lines[1].endswith("MISSED (0.30x: +3.0% against fsdp2/dcp-process's +10.0%)"), lines
    assert lines[2].endswith("MET (2.00 ms against 6.00 + 1 ms)"), lines
    assert all(line in bench_snapshot.verdicts(rows, 2) for line in lines)
    text = bench_snapshot.table(rows, "cmd", "env", 2)
    assert "| 1.50x | 10.00 | 2.00 | - | - | 3 |" in text  # ftsdp/storage
    assert "| 1.00x | 10.00 | 2.00 | - | 6.00 | 3 |" in text  # the floor and its copy


def test_a_floor_that_cost_nothing_gives_no_ratio() -> None:
    """A floor whose overhead is not above zero (noise) divides nothing: "n/a", no verdict."""
    overheads = {"ftsdp/floor": -0.01, "ftsdp/storage": 0.03, "fsdp2/dcp": 0.40}
    rows = bench_snapshot.summarize(_ranks(overheads, [[0.004], [0.004]]))
    assert rows["ftsdp/storage"]["overhead_per_floor"] is None
    assert "| +3.0% to +3.0% | n/a |" in bench_snapshot.table(rows, "cmd", "env", 2)
    first = bench_snapshot.floor_verdicts(rows, "ftsdp/storage")[0]
    assert first.endswith("n/a (+3.0% against -1.0%)"), first
    # without the floor in the run, the column is "-" and only DCP's verdict remains
    del rows["ftsdp/floor"]
    assert "| +3.0% to +3.0% | - |" in bench_snapshot.table(rows, "cmd", "env", 2)
    (only,) = bench_snapshot.floor_verdicts(rows, "ftsdp/storage")
    assert "MET (0.08x: +3.0% against fsdp2/dcp's +40.0%)" in only
