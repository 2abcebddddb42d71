"""Busy-rank benchmark: does background Python work slow the step by where it runs?

    python -m ftsdp.tools.bench_busy_rank --ms 40 --rounds 20

The built-in GPT trains on ``--world`` CPU ranks (gloo) without saving, as in
``bench_snapshot``. Every ``--every`` steps, where a save would start, a thread starts and runs
``--ms`` milliseconds of CPU in pure Python (the kind of work a save's planning, commit and
retention do): on rank 0 alone, on the last rank alone, or split evenly over every rank. Each
such round follows a round without the work (its pair), and the overhead is the median over
rounds of a round's step time over its pair's, as in ``bench_snapshot``.

What it shows: the ranks meet at every step's collectives, so the step takes as long as the
busiest rank's, and a thread's Python holds its process's GIL, which the training loop needs
between operators, so that rank's loop waits for it even when a core is free. The work of one
rank then costs the whole step about as much as the same work on every rank, and twice what
half of it on each costs. A save's coordinator (rank 0: the manifest, the commit, retention)
is therefore what sets its overhead.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from ftsdp.tools import bench_snapshot
from ftsdp.tools._markdown import replace_section


def burn(seconds: float) -> None:
    """Run ``seconds`` of this thread's CPU time in pure Python."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(200):
            x += i


class _Busy(bench_snapshot._Run):
    """The unsaved loop, with ``seconds`` of Python work started where each save would be."""

    def __init__(self, cfg: dict[str, Any], seconds: float) -> None:
        super().__init__("ftsdp", "none", cfg, cfg["root"])
        self.seconds = seconds
        self.threads: list[threading.Thread] = []

    def save(self) -> None:
        if self.seconds > 0:
            t = threading.Thread(target=burn, args=(self.seconds,), daemon=True)
            t.start()
            self.threads.append(t)

    def finish_saves(self) -> None:
        for t in self.threads:
            t.join()
        self.threads.clear()


PLACES = ("rank 0", "last rank", "every rank")


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Time the unloaded loop and each placement of the work, paired by round (rank 0's view:
    its times are barrier to barrier)."""
    if cfg.get("switch_interval_ms"):
        sys.setswitchinterval(cfg["switch_interval_ms"] / 1e3)
    seconds = cfg["ms"] / 1e3
    share = {
        "rank 0": seconds if rank == 0 else 0.0,
        "last rank": seconds if rank == world - 1 else 0.0,
        "every rank": seconds / world,
    }
    base = _Busy(cfg, 0.0)
    runs = {place: _Busy(cfg, share[place]) for place in PLACES}
    ratios: dict[str, list[float]] = {place: [] for place in PLACES}
    order = random.Random(cfg["seed"])
    for _ in range(cfg["rounds"]):
        for place in order.sample(PLACES, len(PLACES)):
            for run in (base, runs[place]):
                gc.collect()
                run.round()
            ratios[place].append(runs[place].times[-1] / base.times[-1] - 1)
    return {"ratios": ratios, "step_s": statistics.median(base.times)}


def main(argv: list[str] | None = None) -> None:
    from ftsdp.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_snapshot.loop_arguments(p)  # (--every: where the saves would be)
    p.add_argument("--ms", type=float, default=40.0, help="Python CPU per busy period, in ms")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the interpreter's thread switch interval on every rank (default: left at 5 ms)",
    )
    p.add_argument("--out", default=None, help="Markdown file whose Busy rank section to write")
    args = p.parse_args(argv)
    command = "python -m ftsdp.tools.bench_busy_rank " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    root = tempfile.mkdtemp(prefix="bench_busy_rank-")
    cfg = {
        **bench_snapshot.loop_config(args, root),
        "ms": args.ms,
        "switch_interval_ms": args.switch_interval_ms,
    }
    try:
        out = run_ranks(rank_main, args.world, cfg, threads=args.threads, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    step = out["step_s"]
    period = step * args.every
    lines = [
        "## Busy rank",
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; W={args.world} gloo ranks, the "
        f"built-in GPT ({args.n_layer} layers x {args.n_embd}) without saving, step {step * 1e3:.1f} ms "
        f"unloaded; {args.ms:.0f} ms of Python every {args.every} steps is "
        f"{args.ms / 1e3 / period:.1%} of their time; thread switch interval "
        f"{args.switch_interval_ms if args.switch_interval_ms else 5:g} ms; "
        f"{os.cpu_count()} CPUs)",
        "",
        "| the work runs on | overhead | overhead, middle half of the rounds |",
        "|---|---|---|",
    ]
    for place in PLACES:
        q1, median, q3 = bench_snapshot._quartiles(out["ratios"][place])
        lines.append(f"| {place} | {median:+.1%} | {q1:+.1%} to {q3:+.1%} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, "## Busy rank")


if __name__ == "__main__":
    main()
