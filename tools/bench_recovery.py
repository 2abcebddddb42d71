"""Recovery benchmark: where the time from a worker's kill -9 to its group's first new step goes.

    python -m ftsdp.tools.bench_recovery --runs 5 --out docs/benchmarks.md

Each run is one job of the fault suite's tiny configuration (tests/e2e/test_faults.py: GPT with 2
layers, width 32; global batch 12; checkpoint every 2 steps, async; ``--deterministic``) on
``torchrun --standalone --nproc-per-node=2 --max-restarts=1`` with ``FTSDP_FAULT=kill:rank=1:
step=3``: rank 1 SIGKILLs itself after step 3, torchrun restarts the group, which resumes from
step 2. The times come from the job's own records: the fault log (``FTSDP_FAULT_LOG``), the
``error`` record of the survivor whose collective failed (detection), torchrun's agent log
(``LOGLEVEL=INFO``: when it noticed the dead worker, stopped the survivor, rendezvoused again
and started the new group) and the new rank 0's ``phases`` record (``--metrics``; see
``ftsdp/trainer/_phases.py``): its process start, imports, store, join, process group, session,
build, resume and first step. The phases after the fault are consecutive, so they add up to
fault -> first new step; detection overlaps the agent's notice and is shown apart. The first
incarnation of every run is a cold start, reported in its own table (launch -> first step).

``--setups`` picks what is compared, a launcher and a rendezvous each: ``torchrun`` (``python -m
torch.distributed.run --standalone ... -m ftsdp.train``, the fault suite's), ``launch``
(``python -m ftsdp.launch --standalone ...``: torchrun's agent with workers forked from a process
that imported ftsdp, torch and torch._dynamo once; ``ftsdp/launch.py``), and each with the
static rendezvous of one node instead of c10d (``--rdzv-backend=static --master-addr=127.0.0.1
--master-port=PORT --nnodes=1``: ``torchrun-static``, ``launch-static``). The jobs of the setups
take turns, so a change of the machine's load meets all of them. Prints the tables (median, min
and max over the runs); ``--out FILE`` also writes them into the "Recovery" section of FILE.
Every job lives in a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from ftsdp.tools._markdown import replace_section

FAULT_STEP = 3
TARGET_S = 3.0  # kill -9 to first new step (the target)
JOB = [
    *["--vocab-size", "64", "--block-size", "16", "--n-layer", "2", "--n-head", "2"],
    *["--n-embd", "32", "--global-batch", "12", "--micro-batch", "1", "--steps", "5"],
    *["--lr", "1e-2", "--warmup", "2", "--log-every", "1", "--device", "cpu", "--deterministic"],
    *["--checkpoint-every", "2", "--heartbeat-timeout-s", "4", "--pg-timeout-s", "60"],
]
AGENT_FLAGS = ["--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1"]
STATIC = "--rdzv-backend=static --master-addr=127.0.0.1 --master-port={port} --nnodes=1"
# setup -> (launcher, its rendezvous flags); "torchrun" is the fault suite's.
SETUPS = {
    "torchrun": ("torchrun", "--standalone"),
    "torchrun-static": ("torchrun", STATIC),
    "launch": ("launch", "--standalone"),
    "launch-static": ("launch", STATIC),
}
TITLES = {
    "torchrun": "`torchrun --standalone -m ftsdp.train`",
    "torchrun-static": "`torchrun` static rdzv `-m ftsdp.train`",
    "launch": "`python -m ftsdp.launch --standalone`",
    "launch-static": "`python -m ftsdp.launch` static rdzv",
}

# (row, what it measures): the worker's phases, from its ``phases`` record.
WORKER_ROWS = [
    ("interpreter", "interpreter start or fork (process start -> ftsdp/train.py runs)"),
    ("import_torch", "import torch (and torch._dynamo, which torch.optim imports)"),
    ("import_ftsdp", "import ftsdp"),
    ("connect", "connect to the c10d store"),
    ("rendezvous", "join handshake (waits for every rank)"),
    ("process_group", "process group"),
    ("session", "session (logs, signals, watchdog)"),
    ("build", "build (data, model, wrap, optimizer, checkpoint peek)"),
    ("load", "load (resume: list, agree, read resharded)"),
    ("first_step", "first step"),
]
FAULT_ROWS = [
    ("agent_notice", "agent notices the dead worker (fault -> SIGTERM to the survivor)"),
    ("agent_stop", "agent stops the survivor"),
    ("agent_rendezvous", "agent rendezvous again"),
    ("spawn", "agent starts the new worker (-> its process start)"),
    *WORKER_ROWS,
]
COLD_ROWS = [
    ("agent_start", "agent start (launch -> it starts the workers)"),
    ("spawn", "agent starts the worker (-> its process start)"),
    *WORKER_ROWS,
]
# torchrun's agent log (glog style: I1130 17:11:57.556000 PID FILE:LINE] message)
AGENT_LINE = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +\d+ [^\]]*\] (.*)$")


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="jobs per setup (median, min, max)")
    p.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, any of {', '.join(SETUPS)} (launcher and rendezvous)",
    )
    p.add_argument("--dir", default=None, help="parent of the temporary job directories")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per job")
    p.add_argument("--out", default=None, help="Markdown file whose Recovery section to write")
    args = p.parse_args(argv)
    args.setups = [x.strip() for x in args.setups.split(",") if x.strip()]
    bad = sorted(set(args.setups) - set(SETUPS))
    if bad or not args.setups:
        p.error(f"--setups: unknown {bad}; use {', '.join(SETUPS)}")
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return args


def _jsonl(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def agent_events(log: str, year: int) -> list[tuple[float, str]]:
    """``(wall time, message)`` of every line of torchrun's agent in ``log`` (local time; the
    glog prefix has no year, ``year`` supplies it)."""
    out = []
    for line in log.splitlines():
        m = AGENT_LINE.match(line)
        if m:
            mon, day, hh, mm, ss, us = (int(x) for x in m.groups()[:6])
            t = time.mktime((year, mon, day, hh, mm, ss, 0, 0, -1)) + us / 1e6
            out.append((t, m.group(7)))
    return out


def _first(events: list[tuple[float, str]], after: float, *needles: str) -> float | None:
    return next((t for t, msg in events if t >= after and any(n in msg for n in needles)), None)


def _worker_phases(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.get("seconds", {}).items()}


def analyse(
    launched: float, metrics: list[dict], faults: list[dict], agent: list[tuple[float, str]]
) -> dict[str, dict[str, float]]:
    """One job's cold start and recovery, phase -> seconds (see the module docstring)."""
    phases = [r for r in metrics if r.get("event") == "phases"]
    if len(phases) < 2 or not faults:
        raise RuntimeError(
            f"expected a fault and two phases records (cold start, restart), got {len(faults)} "
            f"faults and {len(phases)} phases records: see the job's log"
        )
    cold_rec, new_rec = phases[0], phases[-1]
    fault = faults[0]["time"]
    cold: dict[str, float] = {}
    cold_start = cold_rec["marks"].get("process_start")
    starting = _first(agent, launched, "Starting worker group")
    if starting is not None and cold_start is not None:
        cold["agent_start"] = starting - launched
        cold["spawn"] = cold_start - starting
    cold.update(_worker_phases(cold_rec))
    cold["total"] = cold_rec["marks"]["first_step"] - launched

    rec: dict[str, float] = {}
    detected = next(
        (r["time"] for r in metrics if r.get("event") in ("error", "stall") and r["time"] >= fault),
        None,
    )
    if detected is not None:
        rec["detection"] = detected - fault
    new_start = new_rec["marks"].get("process_start")
    notice = _first(agent, fault, "closing signal", "failed (exitcode", "Worker group FAILED")
    failed = _first(agent, fault, "Worker group FAILED", "Worker group UNHEALTHY")
    restart = _first(agent, fault, "Starting worker group")
    if None not in (notice, failed, restart, new_start):
        assert notice is not None and failed is not None and restart is not None
        assert new_start is not None
        rec["agent_notice"] = notice - fault
        rec["agent_stop"] = failed - notice
        rec["agent_rendezvous"] = restart - failed
        rec["spawn"] = new_start - restart
    elif new_start is not None:
        rec["spawn"] = new_start - fault  # the agent's log was not readable: one row
    rec.update(_worker_phases(new_rec))
    rec["total"] = new_rec["marks"]["first_step"] - fault
    rec["resumed_step"] = float(new_rec.get("resumed_step") or -1)
    return {"cold": cold, "recovery": rec}


def command(setup: str) -> list[str]:
    """The launcher's command line of ``setup``, up to ftsdp.train's flags."""
    launcher, rdzv = SETUPS[setup]
    agent = [*rdzv.format(port=_free_port()).split(), *AGENT_FLAGS]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *agent, "-m", "ftsdp.train"]
    return [sys.executable, "-m", "ftsdp.launch", *agent, "--"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(setup: str, parent: str, timeout: float) -> dict[str, dict[str, float]]:
    """One job of ``setup``; its analysis."""
    root = tempfile.mkdtemp(prefix=f"recovery-{setup}-", dir=parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        FTSDP_FAULT=f"kill:rank=1:step={FAULT_STEP}",
        FTSDP_FAULT_LOG=os.path.join(root, "faults.jsonl"),
        LOGLEVEL="INFO",  # torchrun's agent logs its restart steps
        OMP_NUM_THREADS="1",
    )
    cmd = [
        *command(setup),
        *JOB,
        *["--checkpoint-url", os.path.join(root, "ckpt")],
        *["--metrics", os.path.join(root, "metrics.jsonl")],
    ]
    launched = time.time()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{log[-6000:]}")
    year = datetime.datetime.fromtimestamp(launched).year
    result = analyse(
        launched,
        _jsonl(os.path.join(root, "metrics.jsonl")),
        _jsonl(os.path.join(root, "faults.jsonl")),
        agent_events(log, year),
    )
    shutil.rmtree(root, ignore_errors=True)
    return result


def _stats(values: list[float]) -> str:
    """``median [min, max]`` in seconds; ``-`` without values."""
    if not values:
        return "-"
    med, lo, hi = (round(v, 2) + 0.0 for v in (statistics.median(values), min(values), max(values)))
    return f"{med:.2f} [{lo:.2f}, {hi:.2f}]"  # + 0.0 above: no -0.00


def table(
    title: str,
    rows: list[tuple[str, str]],
    total: str,
    kind: str,
    results: dict[str, list[dict[str, dict[str, float]]]],
) -> list[str]:
    launchers = list(results)
    head = "| seconds: median [min, max] | " + " | ".join(TITLES[name] for name in launchers)
    lines = [title, "", head + " |", "|---|" + "---|" * len(launchers)]
    for key, label in [*rows, ("total", total)]:
        cells = []
        for name in launchers:
            values = [r[kind][key] for r in results[name] if key in r[kind]]
            cells.append(_stats(values))
        bold = "**" if key == "total" else ""
        lines.append(f"| {bold}{label}{bold} | " + " | ".join(cells) + " |")
    if kind == "recovery":
        cells = [_stats([r["recovery"]["detection"] for r in results[n]
                         if "detection" in r["recovery"]]) for n in launchers]  # fmt: skip
        lines.append(
            "| detection: the survivor's collective fails (overlaps the agent's notice) | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def report(
    args: argparse.Namespace,
    results: dict[str, list[dict]],
    load: float,
    load_end: float | None = None,
) -> str:
    import torch  # the version in the header only

    pyc = "off (PYTHONDONTWRITEBYTECODE=1)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "on"
    lines = [
        "## Recovery",
        "",
        f"`python -m ftsdp.tools.bench_recovery --runs {args.runs} --setups "
        f"{','.join(args.setups)} --out docs/benchmarks.md` ({datetime.date.today()}; "
        f"{args.runs} jobs per setup, taking turns; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, 1-minute load average {load:.1f} at the start"
        + ("" if load_end is None else f", {load_end:.1f} at the end")
        + f"; Python's bytecode cache {pyc})",
        "",
        "Job: the fault suite's (2 ranks, `--nproc-per-node=2 --max-restarts=1 "
        f"--monitor-interval=0.1`), `FTSDP_FAULT=kill:rank=1:step={FAULT_STEP}`: rank 1 is "
        f"SIGKILLed after step {FAULT_STEP}, the group restarts and resumes from step "
        f"{FAULT_STEP - 1}. Static rdzv: `{STATIC.format(port='PORT')}` instead of "
        "`--standalone`. The rows after the fault follow each other and add up to the total "
        "(their medians need not); a process start is known to a clock tick (10 ms), so the "
        "row that ends at it may show -0.01.",
        "",
    ]
    lines += table(
        "kill -9 of a worker -> first new step:",
        FAULT_ROWS,
        "fault -> first new step",
        "recovery",
        results,
    )
    lines += [""]
    lines += table(
        "Cold start of the same job (its first incarnation, no checkpoint yet):",
        COLD_ROWS,
        "launch -> first step",
        "cold",
        results,
    )
    lines.append("")
    for name in results:
        total = statistics.median(r["recovery"]["total"] for r in results[name])
        verdict = "MET" if total <= TARGET_S else "MISSED"
        lines.append(
            f"- {TITLES[name]}: kill -9 to first new step {total:.2f} s (median): {verdict} "
            f"(target <= {TARGET_S:g} s)"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    load = os.getloadavg()[0]
    parent = tempfile.mkdtemp(prefix="bench_recovery-", dir=args.dir)
    results: dict[str, list[dict]] = {name: [] for name in args.setups}
    try:
        for i in range(args.runs):
            for name in args.setups:  # taking turns, so a change of load meets every setup
                result = run_job(name, parent, args.timeout)
                results[name].append(result)
                print(
                    f"run {i + 1}/{args.runs} {name}: fault -> first new step "
                    f"{result['recovery']['total']:.2f} s, cold start "
                    f"{result['cold']['total']:.2f} s",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    text = report(args, results, load, os.getloadavg()[0])
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, "## Recovery")


if __name__ == "__main__":
    main()
