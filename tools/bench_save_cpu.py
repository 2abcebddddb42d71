"""Save CPU benchmark: where the CPU a save adds to a training loop goes, thread by thread.

    python -m ftsdp.tools.bench_save_cpu --rounds 16

The built-in GPT trains on ``--world`` CPU ranks (gloo) under ``ftsdp.FSDP``, as in
``bench_snapshot``: once without saving and once with ``CheckpointManager`` saving every
``--every`` steps (deferred copy, to ``--dir``, default ``/dev/shm``), the two taking turns in a
seeded random order for ``--rounds`` rounds of ``--steps`` steps. Around each round every rank
reads each of its threads' CPU time from ``/proc/self/task`` (user + system, the kernel's clock
ticks), so the table shows, per rank and per step, what the process used without saving and
what each thread used more with it: the save's own threads (``storage-snapshot``: the plan and
the commit, one thread per save, which has ended by the time the round's CPU is read: in
"threads that ended"; ``storage-save``: the writes), the training loop's thread (which makes the save
call, and waits for the GIL and the caches the save's threads use) and gloo's threads. The wall
time per step is the mean over rounds, barrier to barrier; noisy on a shared machine, it is
there to set the CPU beside.

Linux only (``/proc``). Prints a Markdown table; ``--out FILE`` writes it into FILE's "Save CPU"
section.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

from ftsdp.tools import bench_snapshot
from ftsdp.tools._markdown import replace_section

MODES = ("none", "storage")


def thread_cpu(task_dir: str = "/proc/self/task") -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, by name: a Python thread's
    name (the storage threads' without their per-save or per-thread suffix), else
    ``native:<comm>``; threads of one name summed."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                stat = f.read()
            with open(f"{task_dir}/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        name = names.get(int(tid), f"native:{comm}")
        for prefix in ("storage-save", "storage-snapshot"):  # a save's or a root's threads
            if name.startswith(prefix):
                name = prefix
        out[name] = out.get(name, 0.0) + seconds
    return out


def added(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each thread's CPU between two ``thread_cpu`` readings (a thread that ended in between is
    missing from the second: its CPU is lost, not negative)."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Both modes' rounds, taking turns; per mode the CPU by thread and the wall time."""
    runs = {mode: bench_snapshot._Run("ftsdp", mode, cfg, cfg["root"]) for mode in MODES}
    cpu: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    order = random.Random(cfg["seed"])
    for _ in range(cfg["rounds"]):
        for mode in order.sample(MODES, len(MODES)):
            gc.collect()
            start, process = thread_cpu(), time.process_time()
            runs[mode].round()
            used = added(start, thread_cpu())
            threads = sum(used.values())
            used["process"] = time.process_time() - process
            # a save's own thread (a deferred save's: the plan and the commit) ends with it
            used["threads that ended"] = max(0.0, used["process"] - threads)
            for name, seconds in used.items():
                cpu[mode][name] = cpu[mode].get(name, 0.0) + seconds
    for run in runs.values():
        run.saver.close()
    steps = cfg["rounds"] * cfg["steps"]
    return {
        "cpu": {m: {k: v / steps for k, v in c.items()} for m, c in cpu.items()},
        "wall": {m: sum(runs[m].times) / len(runs[m].times) for m in MODES},
    }


def table(results: list[dict[str, Any]], command: str, every: int, header: str = "") -> str:
    """The Markdown section: per rank, the process's CPU per step without saving and with it,
    and what each thread used more (milliseconds per step and per save)."""
    lines = [
        "## Save CPU",
        "",
        f"`{command}` ({datetime.date.today().isoformat()}; {header}; milliseconds of CPU, "
        "user + system, per step)",
        "",
        "| rank | thread | without saving | with saving | more per step | more per save |",
        "|---|---|---|---|---|---|",
    ]
    for rank, out in enumerate(results):
        none, saving = out["cpu"]["none"], out["cpu"]["storage"]
        names = sorted(set(none) | set(saving), key=lambda n: (n != "process", n))
        for name in names:
            a, b = none.get(name, 0.0), saving.get(name, 0.0)
            if max(a, b) < 0.5e-3 and name != "process":
                continue
            label = "the whole process" if name == "process" else name
            lines.append(
                f"| {rank} | {label} | {a * 1e3:.1f} | {b * 1e3:.1f} | {(b - a) * 1e3:+.1f} "
                f"| {(b - a) * every * 1e3:+.1f} |"
            )
        wall = out["wall"]
        lines.append(
            f"| {rank} | wall time, barrier to barrier | {wall['none'] * 1e3:.1f} "
            f"| {wall['storage'] * 1e3:.1f} | {(wall['storage'] - wall['none']) * 1e3:+.1f} "
            f"| {(wall['storage'] - wall['none']) * every * 1e3:+.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from ftsdp.testing import run_ranks

    if not os.path.isdir("/proc/self/task"):
        raise SystemExit("bench_save_cpu: needs Linux's /proc/self/task")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_snapshot.loop_arguments(p)
    p.add_argument("--dir", default="/dev/shm", help="parent of the checkpoints")
    p.add_argument("--out", default=None, help="Markdown file whose Save CPU section to write")
    args = p.parse_args(argv)
    command = "python -m ftsdp.tools.bench_save_cpu " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    header, before = bench_snapshot.environment(args), bench_snapshot.reference_loop_ms()
    root = tempfile.mkdtemp(prefix="bench_save_cpu-", dir=args.dir)
    try:
        cfg = bench_snapshot.loop_config(args, root)
        results = run_ranks(rank_main, args.world, cfg, threads=args.threads, timeout=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = table(results, command, args.every, header + bench_snapshot.speed_note(before))
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, "## Save CPU")


if __name__ == "__main__":
    main()
