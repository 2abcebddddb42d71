"""The fault-injection suite: real torchrun jobs of ``ftsdp.train`` on gloo, faults injected
deterministically at step boundaries (``FTSDP_FAULT``, see ``ftsdp/testing/_faults.py``).

Every scenario is compared with one uninterrupted single-process run of the same configuration
(deterministic mode makes it valid for every world size): final weights and optimizer state
(bitwise when the engine has ``FSDP(deterministic=True)``, else within tolerance), per-step
losses, and the sample ledger (the dataset indices of every global step: identical, nothing
lost, nothing repeated; a step re-run after a restart must see the same samples). Measured
times (fault -> detection, fault -> first new step) and steps lost are printed and appended to
``$FTSDP_FAULT_REPORT`` when set (docs/elastic.md has the table).

Independent jobs run side by side (:class:`Background`): the reference run and job B (the
resize job) start with job A, whose restarts leave the cores idle for seconds at a time. When
the suite measures (``$FTSDP_FAULT_REPORT`` set) every job runs alone, as before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.trainer._phases import MARKS

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 12
TINY = [
    *["--vocab-size", "64", "--block-size", "16", "--n-layer", "2", "--n-head", "2"],
    # 10 micro-batches: uneven shares at world sizes 3 (4-3-3) and 4 (3-3-2-2)
    *["--n-embd", "32", "--global-batch", "10", "--micro-batch", "1", "--steps", str(STEPS)],
    *["--lr", "1e-2", "--warmup", "2", "--min-lr", "1e-3", "--log-every", "1", "--device", "cpu"],
    *["--deterministic", "--checkpoint-every", "2", "--keep-last", "20"],
    *["--heartbeat-timeout-s", "4", "--preempt-grace-s", "15", "--pg-timeout-s", "60"],
]


def _jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclasses.dataclass
class Run:
    """One job's directory: checkpoints, metrics, ledger, fault log, launcher output."""

    root: pathlib.Path
    url: str = ""
    launches: int = 0
    last_log: pathlib.Path | None = None
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = self.url or str(self.root / "ckpt")

    def metrics(self) -> list[dict]:
        return _jsonl(self.root / "metrics.jsonl")

    def ledger(self) -> list[dict]:
        return _jsonl(self.root / "ledger.jsonl")

    def faults(self) -> list[dict]:
        return _jsonl(self.root / "faults.jsonl")

    def args(self) -> list[str]:
        return [
            *TINY,
            *["--checkpoint-url", self.url, "--metrics", str(self.root / "metrics.jsonl")],
            *["--ledger", str(self.root / "ledger.jsonl")],
        ]

    def env(self, faults: str = "", extra: dict[str, str] | None = None) -> dict[str, str]:
        drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTSDP_FAULT")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.update(OMP_NUM_THREADS="1", FTSDP_FAULT_LOG=str(self.root / "faults.jsonl"))
        if faults:
            env["FTSDP_FAULT"] = faults
        env.update(extra or {})
        return env

    def log_path(self, name: str) -> pathlib.Path:
        self.launches += 1
        return self.root / f"{self.launches:02d}-{name}.log"

    def run(self, cmd: list[str], env: dict[str, str], name: str, timeout: float) -> int:
        """Run a launcher to completion; its output goes to a log file in the run dir."""
        log = self.last_log = self.log_path(name)
        with open(log, "w") as out:
            proc = subprocess.run(
                [*cmd, *self.args()],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        return proc.returncode

    def torchrun(
        self,
        nproc: int,
        *,
        faults: str = "",
        max_restarts: int = 0,
        timeout: float = 150,
        launch: bool = False,
    ) -> int:
        """The job under torchrun (``-m ftsdp.train``), or under ``python -m ftsdp.launch``
        (torchrun's agent, workers forked from a preloaded process) when ``launch``."""
        agent = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
        agent.append("--monitor-interval=0.2")
        if launch:
            cmd = [sys.executable, "-m", "ftsdp.launch", *agent, "--"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", *agent, "-m", "ftsdp.train"]
        name = "launch" if launch else "torchrun"
        return self.run(cmd, self.env(faults), f"{name}-w{nproc}", timeout)

    def output(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.root.glob("*.log")))

    def final(self) -> dict[str, torch.Tensor]:
        return storage.load_state_dict(self.url, step=STEPS, storage_options=self.storage_options)


def side_by_side() -> bool:
    """Whether independent jobs may run at once: not while the suite measures
    (``$FTSDP_FAULT_REPORT`` set), so that each measured time is one job's alone."""
    return not os.environ.get("FTSDP_FAULT_REPORT")


class Background:
    """``fn(*args)`` in a thread of its own, started now when ``start`` (default:
    :func:`side_by_side`), else run by the first :meth:`result` call."""

    def __init__(self, fn: Callable[..., Any], *args: Any, start: bool | None = None) -> None:
        self._fn, self._args = fn, args
        self._future: Future = Future()
        self._thread: threading.Thread | None = None
        if side_by_side() if start is None else start:
            self._thread = threading.Thread(target=self._run, name=fn.__name__)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._future.set_result(self._fn(*self._args))
        except BaseException as e:
            self._future.set_exception(e)

    def result(self, timeout: float | None = None) -> Any:
        """``fn``'s return value (its exception re-raised), waiting up to ``timeout`` s."""
        if self._thread is None and not self._future.done():
            self._run()
        return self._future.result(timeout)


_REFERENCE: dict[str, Background] = {}


def _reference_run(tmp_root: pathlib.Path) -> Run:
    run = Run(tmp_root / "reference")
    rc = run.run([sys.executable, "-m", "ftsdp.train"], run.env(), "python", timeout=120)
    assert rc == 0, run.output()[-4000:]
    return run


def start_reference(tmp_root: pathlib.Path) -> None:
    """Start the uninterrupted run beside what comes next (once per session; see
    :class:`Background`)."""
    if "ref" not in _REFERENCE:
        _REFERENCE["ref"] = Background(_reference_run, tmp_root)


def reference(tmp_root: pathlib.Path) -> Run:
    """The uninterrupted run, one plain process (world size 1), shared by every scenario."""
    start_reference(tmp_root)
    return _REFERENCE["ref"].result(timeout=150)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Run:
    return reference(tmp_path_factory.getbasetemp())


# -- checks -------------------------------------------------------------------------------------


def effective(records: list[dict]) -> dict[int, dict]:
    """Per step, the record of the incarnation whose result survived (the last one)."""
    return {r["step"]: r for r in records}


def check_against_reference(run: Run, ref: Run) -> None:
    # The sample ledger: every step, the same samples as the reference, none lost or repeated.
    seen: dict[int, list[int]] = {}
    for rec in run.ledger():
        if rec["step"] in seen:  # a step re-run after a restart sees the same samples
            assert rec["ids"] == seen[rec["step"]], f"step {rec['step']} changed its samples"
        seen[rec["step"]] = rec["ids"]
    mine, theirs = effective(run.ledger()), effective(ref.ledger())
    assert sorted(mine) == list(range(1, STEPS + 1)), sorted(mine)
    assert {s: r["ids"] for s, r in mine.items()} == {s: r["ids"] for s, r in theirs.items()}
    ids = [i for s in sorted(mine) for i in mine[s]["ids"]]
    assert len(ids) == len(set(ids)), "a sample was used twice"

    # Per-step losses and the final state.
    losses = {s: r["loss"] for s, r in effective(_steps(run)).items()}
    ref_losses = {s: r["loss"] for s, r in effective(_steps(ref)).items()}
    assert sorted(losses) == list(range(1, STEPS + 1))
    final, expected = run.final(), ref.final()
    assert final.keys() == expected.keys()
    assert losses == ref_losses  # deterministic mode: bitwise, at every world size
    for k in expected:
        assert torch.equal(final[k], expected[k]), k


def _steps(run: Run) -> list[dict]:
    return [r for r in run.metrics() if r["event"] == "step"]


def check_committed_steps_readable(run: Run) -> list[int]:
    steps = storage.list_steps(run.url)
    for step in steps:
        storage.load_state_dict(run.url, step=step, keys=["model.wte.weight"])
    return steps


def measure(run: Run, scenario: str, command: str, fault_index: int = 0) -> dict[str, Any]:
    """Times and steps lost of one fault (:func:`timings`), printed and appended to
    ``$FTSDP_FAULT_REPORT`` when set."""
    result = {"scenario": scenario, **timings(run, fault_index), "command": command}
    print(json.dumps(result))
    report = os.environ.get("FTSDP_FAULT_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def timings(run: Run, fault_index: int = 0) -> dict[str, Any]:
    """Times and steps lost of one fault, from the fault log, ledger and metrics."""
    fault = run.faults()[fault_index]
    t = fault["time"]
    events = sorted(run.metrics(), key=lambda r: r["time"])
    detected = next(
        (r for r in events if r["time"] >= t and r["event"] in ("error", "stall", "preempted")),
        None,
    )
    resumed = next((r for r in events if r["time"] >= t and r["event"] == "resume"), None)
    # The first step the resumed incarnation completed (from the ledger: a step record may
    # never be logged when the next fault fires at that step's boundary).
    first = next(
        (r for r in run.ledger() if resumed and r["incarnation"] == resumed["incarnation"]),
        None,
    )
    # Steps lost: the furthest step the incarnation that met the fault completed, minus the
    # step its successor resumed from.
    done_before = max(
        (r["step"] for r in run.ledger() if r["incarnation"] == fault["incarnation"]), default=0
    )
    return {
        "fault": f"{fault['kind']}{':' + fault['point'] if fault.get('point') else ''}"
        f" rank {fault['rank']} step {fault['step']}",
        "detection_s": None if detected is None else round(detected["time"] - t, 2),
        "detected_by": None if detected is None else detected["event"],
        "fault_to_first_new_step_s": None if first is None else round(first["time"] - t, 2),
        "steps_lost": None if resumed is None else done_before - resumed["step"],
        "resumed_step": None if resumed is None else resumed["step"],
        "world_sizes": f"{resumed and resumed['saved_world_size']} -> "
        f"{resumed and resumed['world_size']}",
    }


# -- scenarios ----------------------------------------------------------------------------------

# One job at world size 2 meets five faults, one per restart (a fault fires only when
# TORCHELASTIC_RESTART_COUNT equals its restart=): the scenarios that restart the group at the
# same size share it, because starting workers is what costs time here. It runs under
# ``python -m ftsdp.launch``, whose workers are forked with their imports done (0.8-1.4 s from a
# fault to the first new step against 5.5-8.3 s under torchrun -m; the whole job 25 s against
# 63 s); the other jobs run under torchrun itself.
RESTART_FAULTS = [
    # after_commit: the kill waits until step 2's async save has committed, so the restart
    # resumes from step 2 however slowly the machine ran (a kill before that commit resumed
    # from scratch under load).
    "kill:rank=1:step=3:when=after_commit:restart=0",
    "crash_in_save:point=after_data:n=1:rank=1:step=4:restart=1",
    "crash_in_save:point=before_manifest:rank=0:step=6:restart=2",
    "crash_in_save:point=before_latest:rank=0:step=8:restart=3",
    "stop:rank=1:step=9:restart=4",
    # one worker preempted alone: both save, one returns, its peer exits 75; under
    # ftsdp.launch the agent once hung there for good
    "term:rank=1:step=10:target=self:restart=5",
]
RESTARTS_COMMAND = (
    "python -m ftsdp.launch --standalone --nproc-per-node=2 --max-restarts=6, FTSDP_FAULT="
)


@pytest.fixture(scope="module")
def restarts(tmp_path_factory, resize: Background) -> Run:
    """Job A. ``resize`` (job B) and the reference run are started first, to run beside it."""
    start_reference(tmp_path_factory.getbasetemp())
    run = Run(tmp_path_factory.mktemp("restarts") / "job")
    rc = run.torchrun(2, faults=";".join(RESTART_FAULTS), max_restarts=6, timeout=400, launch=True)
    assert rc == 0, run.output()[-8000:]
    return run


@pytest.mark.timeout(420)
def test_restarted_job_equals_the_uninterrupted_run(restarts: Run, ref: Run) -> None:
    assert [r["step"] for r in _resumes(restarts)] == [2, 2, 4, 8, 8, _preempted_at(restarts)]
    assert [(r["saved_world_size"], r["world_size"]) for r in _resumes(restarts)] == [(2, 2)] * 6
    check_against_reference(restarts, ref)
    # The RNG states (torch, numpy, Python) too: seeded by --seed, restored at every resume.
    saved, expected = (
        storage.catalog.read_manifest(r.url, STEPS, storage_options=r.storage_options)
        for r in (restarts, ref)
    )
    # (every rank draws the same streams here, so the states are one value, not one per rank)
    assert not any("rng" in v for m in (saved, expected) for v in m.rank_values)
    assert saved.values["rng"] == expected.values["rng"]


@pytest.mark.timeout(420)
def test_kill9_one_worker_restarts_the_group_at_the_same_size(restarts: Run) -> None:
    m = measure(restarts, "kill -9 one worker", RESTARTS_COMMAND + RESTART_FAULTS[0], 0)
    assert m["resumed_step"] == 2 and m["steps_lost"] == 1 and m["world_sizes"] == "2 -> 2"
    assert m["detected_by"] in ("error", "stall") and m["detection_s"] < 10
    # The survivor says it in one line: what happened and where the restart resumes from; no
    # worker prints a traceback, for this fault or any other of the job (the agent's own log
    # lines, prefixed, are torchrun's).
    out = restarts.output()
    assert not re.search(r"^Traceback", out, re.M), out[-6000:]
    lost = re.findall(r"rank 0 ERROR ftsdp\.train: (peer lost.*)", out)
    assert lost and re.fullmatch(
        r"peer lost( after SIGTERM)?: .*Connection (reset|closed) by peer.*; exiting without "
        r"saving, the restart resumes from step 2 \(durable\)",
        lost[0],
    ), lost
    # A signal after the loss (torchrun stopping the group) promises no save. One that arrives
    # before the survivor has seen the loss (the agent saw the exit first) cannot know: that
    # rank's next line must then be the loss, exiting without saving, or (the preemption of
    # the job's last fault, which loses no rank) the save it promised, committed.
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "SIGTERM received" not in line or "nothing will be saved" in line:
            continue
        rank = re.search(r" rank (\d+) ", line)
        assert rank, line
        nxt = next(j for j in range(i + 1, len(lines)) if f" rank {rank.group(1)} " in lines[j])
        saved = any(
            re.search(r"INFO ftsdp\.train: preempted at step \d+: checkpoint committed", x)
            for x in lines[i + 1 : nxt]
        )  # (rank 0 says it for every rank)
        # (under load the watchdog may name the lost peer first: it misses the dead one's
        # heartbeats while this rank waits for the save that one never commits)
        assert saved or re.search(
            r"ERROR ftsdp\.train: (peer lost after SIGTERM: .*; exiting without saving"
            r"|ftsdp watchdog \(rank \d\): rank \d stalled for .*; exiting with 86)",
            lines[nxt],
        ), (line, lines[nxt])


@pytest.mark.timeout(420)
def test_crash_inside_checkpoint_writes_resumes_from_the_last_committed_step(restarts: Run):
    points = [f["point"] for f in restarts.faults()[1:4]]
    assert points == ["after_data", "before_manifest", "before_latest"]
    # The torn attempts (step 4's first, step 6's first) are never loaded; step 8 was committed
    # by its manifest although `latest` still named 6, so the job resumed from 8.
    committed = check_committed_steps_readable(restarts)
    assert {4, 6, 8, 10, 12} <= set(committed), committed
    names = ("after data objects", "before the manifest", "after the manifest, before latest")
    resumed = []
    for i, name in enumerate(names, start=1):
        m = measure(
            restarts,
            f"crash inside a checkpoint write, {name}",
            RESTARTS_COMMAND + RESTART_FAULTS[i],
            i,
        )
        resumed.append(m["resumed_step"])
    assert resumed == [2, 4, 8]


@pytest.mark.timeout(420)
def test_a_stopped_rank_is_detected_named_and_the_job_recovers(restarts: Run) -> None:
    # the SIGSTOP's stall, seen by rank 0 (a crash's survivor may have named its dead peer so
    # before, under load)
    events = [r for r in restarts.metrics() if r["event"] == "stall"]
    stall = [r for r in events if "(rank 0): rank 1 stalled for" in r["message"]]
    assert stall and "no heartbeat" in stall[0]["message"], events
    m = measure(
        restarts,
        "hung rank (SIGSTOP)",
        RESTARTS_COMMAND + RESTART_FAULTS[4] + ", --heartbeat-timeout-s 4",
        4,
    )
    assert m["detected_by"] == "stall" and m["detection_s"] <= 30
    assert m["resumed_step"] == 8


@pytest.mark.timeout(420)
def test_sigterm_to_one_worker_under_the_launcher_restarts_the_group(restarts: Run) -> None:
    """One worker SIGTERMed alone: both ranks save the step they agree on, one returns and its
    peer exits 75, and ``ftsdp.launch`` restarts the group at the same size from that step
    (its agent once hung for good there: a stopped worker never answered its close)."""
    m = measure(
        restarts,
        "SIGTERM to one worker under ftsdp.launch (peer exits 75, group restarts)",
        RESTARTS_COMMAND + RESTART_FAULTS[5],
        5,
    )
    assert m["detected_by"] == "preempted" and m["steps_lost"] == 0, m
    assert m["resumed_step"] == _preempted_at(restarts) and m["world_sizes"] == "2 -> 2"


def _resumes(run: Run) -> list[dict]:
    return [r for r in run.metrics() if r["event"] == "resume"]


def _preempted_at(run: Run) -> int:
    """The step job A's preempted worker group saved at: the signal's step boundary or the
    next (the ranks agree at a boundary)."""
    (stop,) = [r for r in run.metrics() if r["event"] == "preempted"]
    assert stop["step"] in (10, 11), stop
    return int(stop["step"])


@pytest.mark.timeout(420)
def test_every_worker_group_records_where_its_start_went(restarts: Run) -> None:
    """Each of job A's six worker groups wrote one ``phases`` record (rank 0, at its first step;
    ftsdp/trainer/_phases.py): every mark, in order, the first step where the ledger has it,
    each restart's processes started after its fault; and, forked by ``ftsdp.launch`` from a
    process that did the imports, the workers imported nothing themselves."""
    phases = [r for r in restarts.metrics() if r["event"] == "phases"]
    ledger, faults = restarts.ledger(), restarts.faults()
    groups = list(dict.fromkeys(r["incarnation"] for r in ledger))
    assert [r["incarnation"] for r in phases] == groups and len(groups) == 7
    assert [r["restart_count"] for r in phases] == list(range(7))
    assert [r["resumed_step"] for r in phases] == [None, 2, 2, 4, 8, 8, _preempted_at(restarts)]
    for rec in phases:
        assert list(rec["marks"]) == list(MARKS)  # under torchrun's agent every mark applies
        times = list(rec["marks"].values())
        assert times == sorted(times), rec
        assert sum(rec["seconds"].values()) == pytest.approx(rec["total_s"], abs=1e-3)
        first = next(r for r in ledger if r["incarnation"] == rec["incarnation"])
        assert 0 <= first["time"] - rec["marks"]["first_step"] < 1.0, (first, rec)
        assert rec["seconds"]["import_torch"] + rec["seconds"]["import_ftsdp"] < 0.5, rec
    for fault, rec in zip(faults, phases[1:], strict=True):
        assert fault["time"] < rec["marks"]["process_start"] < rec["marks"]["first_step"]


@pytest.mark.timeout(420)
def test_the_report_of_the_job_marks_each_restart_at_its_step(restarts: Run) -> None:
    """``ftsdp-report`` on job A's metrics and fault log (no new job): the panels hold the run's
    records, one restart marker per restart at the step it resumed from (the kill -9 at step 3:
    one marker, at step 2), and each fault table row is the suite's own measurement."""
    from ftsdp.tools.report import build_report

    report = build_report([restarts.root / "metrics.jsonl", restarts.root / "faults.jsonl"])
    assert report.skipped == []
    assert {"loss", "tokens_per_s", "s_per_step", "world_size", "checkpoint", "faults"} <= set(
        report.axes
    )
    loss = report.axes["loss"]
    (line,) = [ln for ln in loss.lines if ln.get_gid() is None]
    steps = sorted(_steps(restarts), key=lambda r: r["time"])
    points = [(x, y) for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True) if x == x]
    assert points == [(r["step"], r["loss"]) for r in steps]
    (world,) = [ln for ln in report.axes["world_size"].lines if ln.get_gid() is None]
    assert {y for y in world.get_ydata() if y == y} == {2.0}
    saves = [r["blocking_s"] for r in restarts.metrics() if r["event"] == "checkpoint"]
    assert [b.get_height() for b in report.axes["checkpoint"].patches] == saves

    resumes, faults = _resumes(restarts), restarts.faults()
    markers = [ln for ln in loss.lines if ln.get_gid() == "marker:restart"]
    assert len(markers) == len(RESTART_FAULTS)
    (stop,) = [ln for ln in loss.lines if ln.get_gid() == "marker:preempted"]
    assert stop.get_xdata()[0] == _preempted_at(restarts)
    assert [ln.get_xdata()[0] for ln in markers] == [r["step"] for r in resumes]
    assert [r["step"] for r in resumes] == [2, 2, 4, 8, 8, _preempted_at(restarts)]
    assert [ln.get_label() for ln in markers] == [
        f"restart {r['restarts']}: from step {r['step']} (world 2)" for r in resumes
    ]
    rows = report.faults
    assert [(r.kind, r.step) for r in rows] == [
        (f["kind"] + (f":{f['point']}" if f["point"] else ""), f["step"]) for f in faults
    ]
    assert (rows[0].kind, rows[0].step, rows[0].resumed_from) == ("kill", 3, 2)
    for i, row in enumerate(rows):
        suite = timings(restarts, i)
        assert row.origin == "fault log" and row.detected_by == suite["detected_by"]
        assert row.detection_s == pytest.approx(suite["detection_s"], abs=0.006)
        assert row.resumed_from == suite["resumed_step"]
        # the suite's first new step is the ledger's record of it, the report's the metrics'
        assert abs(row.first_new_step_s - suite["fault_to_first_new_step_s"]) < 1.0
        # The ledger may hold one step more than the metrics when a crash inside an async save
        # lands after the next step's collectives; a fault at a step boundary is exact.
        lost = suite["steps_lost"]
        assert row.steps_lost == lost or (
            row.kind.startswith("crash") and row.steps_lost == lost - 1
        )


# (world size, faults, max restarts) of each stage of the resize job.
RESIZE_STAGES = [
    (4, "term:rank=0:step=4:target=agent", 0),
    (2, "term:rank=1:step=6:target=self:restart=0;term:rank=0:step=8:target=agent:restart=1", 1),
    (3, "term:rank=0:step=10:target=agent", 0),
    (1, "", 0),
]


def _resize_job(root: pathlib.Path) -> Run:
    """Job B: the stages of RESIZE_STAGES in turn, each ending as the resize test expects."""
    run = Run(root)
    for world, faults, restarts in RESIZE_STAGES:
        rc = run.torchrun(world, faults=faults, max_restarts=restarts)
        assert run.last_log is not None
        out = run.last_log.read_text(errors="replace")
        if not faults:
            assert rc == 0, out[-6000:]
            continue
        # The agent itself dies of the SIGTERM (torchrun exits non-zero); every worker saved
        # and exited 0, except the peer of a worker that was signalled alone (75).
        assert "SignalException" in out, out[-6000:]
        codes = sorted(set(re.findall(r"exitcode: (-?\d+)", out)))
        assert codes == (["75"] if restarts else []), (codes, out[-6000:])
    return run


RESIZE_TEST = "test_sigterm_preemption_and_world_size_changes_4_2_3_1"


@pytest.fixture(scope="module")
def resize(request, tmp_path_factory) -> Background:
    """Job B, started at once (beside job A, see the module docstring) when its test is among
    the selected ones and jobs may run side by side; else run when the test asks for it."""
    selected = any(item.name == RESIZE_TEST for item in request.session.items)
    root = tmp_path_factory.mktemp("resize") / "job"
    return Background(_resize_job, root, start=side_by_side() and selected)


@pytest.mark.timeout(360)
def test_sigterm_preemption_and_world_size_changes_4_2_3_1(resize: Background, ref) -> None:
    """Each stage ends by SIGTERM to its torchrun agent (the first while the async save of that
    step is in flight) and the next stage resumes at another world size. At world size 2 one
    worker is SIGTERMed alone first: both save, the signalled one exits 0, its peer exits 75 so
    torchrun restarts the group at the same size."""
    run = resize.result(timeout=340)
    resumes = _resumes(run)
    assert [(r["saved_world_size"], r["world_size"], r["step"]) for r in resumes] == [
        (4, 2, 5),
        (2, 2, 7),
        (2, 3, 9),
        (3, 1, 11),
    ]
    faults = run.faults()
    preempted = [r for r in run.metrics() if r["event"] == "preempted"]
    assert len(preempted) == len(faults) == 4
    names = [
        "SIGTERM to the agent, world 4 (async save in flight)",
        "SIGTERM to one worker, world 2 (peer exits 75, group restarts)",
        "SIGTERM to the agent, world 2",
        "SIGTERM to the agent, world 3",
    ]
    for i, (fault, stop) in enumerate(zip(faults, preempted, strict=True)):
        # Agreed at the next step boundary, saved synchronously, exited within the grace period.
        assert stop["step"] in (fault["step"], fault["step"] + 1)
        assert stop["time"] - fault["time"] < 15
        assert stop["step"] in storage.list_steps(run.url)
        stage = next(s for s in RESIZE_STAGES if f"step={fault['step']}" in s[1])
        spec = next(f for f in stage[1].split(";") if f"step={fault['step']}" in f)
        m = measure(
            run,
            names[i],
            f"torchrun --standalone --nproc-per-node={stage[0]} "
            f"--max-restarts={stage[2]}, FTSDP_FAULT={spec}",
            i,
        )
        assert m["steps_lost"] == 0, m  # at most one step lost: here none
    check_against_reference(run, ref)
