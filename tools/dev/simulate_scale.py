"""Simulate a save, a resume and the heartbeats of thousands of ranks in one process.

``python -m ftsdp.tools.dev.simulate_scale --worlds 8 64 512 2048 8192 --tensors 600`` runs the real
code of each step for W synthetic ranks, without process groups or data, and prints what one
rank pays, for two layouts of the same T tensors:

- ``flat``: ftsdp's own, the tensors grouped into units of 6 whose concatenation is cut into W
  equal chunks (``FlatShard.layout`` says where each tensor sits);
- ``shard0``: per-parameter sharding (DTensor ``Shard(0)``, what FSDP2 states hold).

Columns:

- planning: a rank's whole part in the save's exchange and planning, the real
  ``storage._exchange.exchange`` (its table and digests, the agreement, the layout and its own
  objects) on stand-in collectives that answer at once; a sample of ranks (first, middle,
  last) is timed and the slowest reported;
- exchanged: the bytes one rank sends and receives in the save's collectives (payloads, as
  counted by the stand-in collectives ``ftsdp.tools.dev.simulation.Wire`` under the real
  ``exchange``; rank 0 in brackets: it also receives every rank's few numbers);
- before: the same rank's cost in the protocol this replaced, every rank's metadata
  all-gathered to every rank and planned there (``make_plan``), up to ``--old-max-world``;
- manifest: its size once every rank's done marker is in (``build_manifest``, the real commit
  code, fed each rank's objects and checksums), the time to encode it, and the time every
  resuming rank takes to decode and validate it;
- load planning: a rank of a world of W/2 planning its reads (``_match`` and ``plan_reads``,
  the code of ``storage.load``) against that manifest, slowest of a sample;
- heartbeats: store operations per interval of the watchdog of W ranks, all ranks together
  (``ftsdp.elastic.simulate_heartbeats``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import torch

from ftsdp.storage import SaveOptions
from ftsdp.tools import _bench_json
from ftsdp.tools._markdown import replace_section
from ftsdp.tools.dev import simulation
from ftsdp.tools.dev.simulation import (
    Manifest,
    commit_manifest,
    leaves,
    load_planning,
    markers,
    old_planning,
    plan_rank,
    sample_ranks,
)

TARGETS = {
    "plan_s": 0.050,
    "exchanged": 1_000_000,
    "manifest": 50e6,
    "decode_s": 1.0,
    "load_s": 0.100,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 2048, 8192])
    p.add_argument("--tensors", type=int, default=600)
    p.add_argument("--layouts", nargs="+", default=["flat", "shard0"], choices=["flat", "shard0"])
    p.add_argument(
        "--old-max-world",
        type=int,
        default=64,
        help="run the all-gather protocol this replaced up to this world size",
    )
    p.add_argument("--sample", type=int, default=3, help="ranks timed per world size")
    p.add_argument(
        "--rows-scale",
        type=int,
        default=1,
        help="multiply every tensor's rows (8: every Shard(0) tensor spans 8192 ranks)",
    )
    p.add_argument("--out", help="replace the '## Scale (simulated)' section of this Markdown file")
    p.add_argument("--json", help="write the results as the 'scale' entry of this JSON file")
    return p.parse_args(argv)


def heartbeats(world: int) -> dict[str, Any]:
    from ftsdp.elastic import simulate_heartbeats

    return simulate_heartbeats(world)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every layout at every world size. The collections before the timed parts keep a
    collection triggered by building the synthetic state out of the timings; the objects alive
    before the run (torch's, and a caller's: a test session's) are frozen meanwhile, so each of
    those collections scans what the run made, not the whole heap (unfrozen at the end, unless
    the caller had frozen some)."""
    gc.collect()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    try:
        return _rows(args)
    finally:
        if freeze:
            gc.unfreeze()


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    simulation.ROW_SCALE = args.rows_scale
    options = SaveOptions()
    rows = []
    for layout in args.layouts:
        for world in args.worlds:
            row: dict[str, Any] = {"layout": layout, "world": world, "tensors": args.tensors}
            slowest = 0.0
            exchanged = {}
            for rank in sample_ranks(world, args.sample):
                held = leaves(layout, world, rank, args.tensors)
                gc.collect()  # not a collection triggered by building the synthetic state
                t0 = time.perf_counter()
                _, exchanged[rank] = plan_rank(held, world, rank, options)
                slowest = max(slowest, time.perf_counter() - t0)
            others = [n for r, n in exchanged.items() if r != 0]
            row.update(plan_s=slowest, exchanged=max(others or exchanged.values()))
            row["exchanged_rank0"] = exchanged.get(0)
            if world <= args.old_max_world:
                row["old_plan_s"], row["old_exchanged"] = old_planning(
                    layout, world, args.tensors, options
                )
            inputs = markers(layout, world, args.tensors, options)
            gc.collect()
            t0 = time.perf_counter()
            data = commit_manifest(inputs, world, options).to_json()
            t1 = time.perf_counter()
            decoded = Manifest.from_json(data, where="simulated")
            t2 = time.perf_counter()
            row.update(manifest=len(data), encode_s=t1 - t0, decode_s=t2 - t1)
            new_world = max(world // 2, 1)
            gc.collect()
            row["load_s"] = max(
                load_planning(decoded, layout, new_world, r, args.tensors)
                for r in sample_ranks(new_world, args.sample)
            )
            beats = heartbeats(world)
            if beats is not None:
                row["heartbeat_ops"] = beats["ops_per_interval"]
            rows.append(row)
            print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1000:.1f} ms"

    def size(x: float | None) -> str:
        return "—" if x is None else f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} kB"

    command = "python -m ftsdp.tools.dev.simulate_scale " + " ".join(sys.argv[1:])
    lines = [
        title(args),
        "",
        f"`{command}` ({environment()}). The real planning, manifest, read-planning and "
        "heartbeat code for W synthetic ranks in one process (no data, no process groups); "
        f"T={args.tensors} tensors; per rank, slowest of {args.sample} sampled ranks. "
        "`before`: every rank's metadata all-gathered and planned on every rank, the "
        "protocol this replaced. Load planning: a rank of W/2 ranks reading this checkpoint.",
        "",
        "| layout | W | planning | exchanged per rank (rank 0) | before: "
        "planning / gathered | manifest | encode | decode | load planning (W→W/2) | "
        "heartbeat ops per interval |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        before = f"{ms(r['old_plan_s'])} / {size(r['old_exchanged'])}" if "old_plan_s" in r else "—"
        beats = r.get("heartbeat_ops")
        ops = "—" if beats is None else f"{beats} ({beats / r['world']:.1f} W)"
        lines.append(
            f"| {r['layout']} | {r['world']} | {ms(r['plan_s'])} | "
            f"{size(r['exchanged'])} ({size(r['exchanged_rank0'])}) | {before} | {size(r['manifest'])} | {ms(r['encode_s'])} | "
            f"{ms(r['decode_s'])} | {ms(r['load_s'])} | {ops} |"
        )
    lines += ["", *verdicts(rows), ""]
    return "\n".join(lines) + "\n"


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target, judged at the largest world simulated."""
    out = []
    top = max(r["world"] for r in rows)
    at = [r for r in rows if r["world"] == top]
    names = {
        "plan_s": "save planning per rank <= 50 ms",
        "exchanged": "metadata exchanged per rank <= 1 MB",
        "manifest": "manifest <= 50 MB",
        "decode_s": "manifest decoded in <= 1 s",
        "load_s": "load planning per rank <= 100 ms",
    }
    for key, what in names.items():
        worst = max(max(r[key], r.get(f"{key}_rank0") or 0) for r in at)
        ok = worst <= TARGETS[key]
        out.append(f"- {'MET' if ok else 'MISSED'} at W={top}: {what} (worst layout: {worst:.4g}).")
    beats = [r for r in at if "heartbeat_ops" in r]
    if beats:
        ops = beats[0]["heartbeat_ops"]
        verdict = "MET" if ops <= 4 * top else "MISSED"
        out.append(
            f"- {verdict} at W={top}: heartbeat store operations per interval <= 4 W ({ops})."
        )
    return out


def title(args: argparse.Namespace) -> str:
    """The Markdown section this run owns (one per ``--rows-scale``)."""
    if args.rows_scale == 1:
        return "## Scale (simulated)"
    return f"## Scale (simulated, {args.rows_scale}x the rows)"


def environment() -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rows = run(args)
    text = table(args, rows)
    sys.stdout.write(text)
    if args.out:
        replace_section(args.out, text, title(args))
    if args.json:
        command = "python -m ftsdp.tools.dev.simulate_scale " + " ".join(
            sys.argv[1:] if argv is None else argv
        )
        name = "scale" if args.rows_scale == 1 else f"scale_rows_x{args.rows_scale}"
        _bench_json.write_entry(args.json, name, {"rows": rows}, command, environment())


if __name__ == "__main__":
    main()
