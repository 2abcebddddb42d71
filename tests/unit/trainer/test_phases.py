"""Where a worker's start goes (``ftsdp/trainer/_phases.py``) and how the recovery benchmark
(``python -m ftsdp.tools.bench_recovery``) reads it: the kernel's process start against the
launching process's clock, phases between the marks present, and one job's records (fault log,
metrics, torchrun's agent log) turned into consecutive phases that add up to fault -> first new
step. The real records of real runs are checked in tests/e2e/test_train_entry.py and
tests/e2e/test_faults.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from ftsdp.tools import bench_recovery
from ftsdp.trainer import _phases
from ftsdp.trainer._phases import MARKS, Phases


def test_process_start_is_the_kernels_start_of_a_child_on_our_clock() -> None:
    """A child loads the module by its path (no torch) and prints its start and its clock: the
    start lies between our launch (less one 10 ms clock tick) and the child's first line."""
    code = (
        "import importlib.util, sys, time; "
        "spec = importlib.util.spec_from_file_location('p', sys.argv[1]); "
        "m = sys.modules['p'] = importlib.util.module_from_spec(spec); "
        "spec.loader.exec_module(m); "
        "print(m.process_start_time(), time.time())"
    )
    launched = time.time()
    out = subprocess.run(
        [sys.executable, "-c", code, _phases.__file__], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    started, now = (float(x) for x in out.stdout.split())
    assert launched - 0.011 <= started <= now, (launched, started, now)


def test_phases_run_from_the_previous_mark_present() -> None:
    p = Phases()
    p.mark("process_start", 100.0)
    p.mark("entry", 100.1)
    p.mark("torch_imported", 102.0)
    p.mark("process_group", 102.5)  # a world of one: no store marks
    p.mark("first_step", 103.0)
    assert p.seconds() == pytest.approx(
        {"interpreter": 0.1, "import_torch": 1.9, "process_group": 0.5, "first_step": 0.5}
    )
    assert p.total() == pytest.approx(3.0)
    record = p.record(world_size=1)
    assert record["event"] == "phases" and record["world_size"] == 1
    assert list(record["marks"]) == ["process_start", "entry", "torch_imported",
                                     "process_group", "first_step"]  # fmt: skip
    assert record["total_s"] == pytest.approx(3.0)
    assert json.loads(json.dumps(record)) == record  # one JSON line of --metrics
    line = p.line()
    assert line.startswith("first step 3.00s after process start | interpreter 0.10s")
    with pytest.raises(ValueError, match="unknown phase mark 'imported'"):
        p.mark("imported")
    assert MARKS[0] == "process_start" and MARKS[-1] == "first_step"


def _glog(t: float, msg: str) -> str:
    """One line as torchrun's agent logs it (local time, microseconds, pid, file:line)."""
    lt = time.localtime(t)
    us = round((t - int(t)) * 1e6)
    return f"I{time.strftime('%m%d %H:%M:%S', lt)}.{us:06d} 4242 api.py:942] {msg}"


def _marks(start: float, **offsets: float) -> dict[str, float]:
    return {m: start + offsets.get(m, 0.0) for m in MARKS}


def test_one_jobs_records_become_consecutive_phases() -> None:
    launched = 1_800_000_000.0
    fault = launched + 20.0
    cold = {
        "event": "phases",
        "marks": _marks(launched + 3.0, entry=0.1, torch_imported=2.0, first_step=4.0),
        "seconds": {"interpreter": 0.1, "import_torch": 1.9, "first_step": 2.0},
        "resumed_step": None,
    }
    new = {
        "event": "phases",
        "marks": _marks(fault + 0.5, entry=0.05, first_step=0.7),
        "seconds": {"interpreter": 0.05, "first_step": 0.65},
        "resumed_step": 2,
    }
    metrics = [cold, {"event": "error", "time": fault + 0.03}, new]
    agent = "\n".join(
        [
            _glog(launched + 2.9, "[default] Starting worker group"),
            "2026-11-30 12:00:00,000 rank 0 INFO ftsdp.train: a worker's line, not the agent's",
            _glog(fault + 0.1, "Sending process 7 closing signal SIGTERM"),
            _glog(fault + 0.2, "[default] Worker group FAILED. 1/1 attempts left"),
            _glog(fault + 0.45, "[default] Starting worker group"),
        ]
    )
    year = time.localtime(launched).tm_year
    got = bench_recovery.analyse(
        launched, metrics, [{"time": fault}], bench_recovery.agent_events(agent, year)
    )
    rec = got["recovery"]
    assert rec["detection"] == pytest.approx(0.03)
    expected = {"agent_notice": 0.1, "agent_stop": 0.1, "agent_rendezvous": 0.25, "spawn": 0.05}
    assert {k: rec[k] for k in expected} == pytest.approx(expected, abs=2e-6)
    assert (rec["interpreter"], rec["first_step"], rec["total"]) == pytest.approx((0.05, 0.65, 1.2))
    consecutive = sum(v for k, v in rec.items() if k not in ("detection", "total", "resumed_step"))
    assert consecutive == pytest.approx(rec["total"], abs=1e-5)
    assert rec["resumed_step"] == 2
    cold_got = got["cold"]
    assert (cold_got["agent_start"], cold_got["spawn"]) == pytest.approx((2.9, 0.1), abs=2e-6)
    assert cold_got["total"] == pytest.approx(7.0)

    args = argparse.Namespace(runs=1, setups=["torchrun"])
    text = bench_recovery.report(args, {"torchrun": [got]}, load=1.0)
    assert "| **fault -> first new step** | 1.20 [1.20, 1.20] |" in text
    assert "| agent rendezvous again | 0.25 [0.25, 0.25] |" in text
    assert "kill -9 to first new step 1.20 s (median): MET (target <= 3 s)" in text

    with pytest.raises(RuntimeError, match="two phases records"):
        bench_recovery.analyse(launched, [cold], [{"time": fault}], [])
