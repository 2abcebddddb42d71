"""Checkpoint benchmark: ``storage`` vs ``torch.distributed.checkpoint`` on local disk, and S3.

    python -m ftsdp.tools.bench_checkpoint --size-mb 250 --ranks 2 --out docs/benchmarks.md

One run saves an FSDP2-style model + AdamW state (DTensor ``Shard(0)``, see the note in
``tools/_bench_ranks.py``) with ``--ranks`` gloo CPU ranks, with ``storage`` and with DCP (sync and
async); then loads it resharded into each of ``--load-ranks`` world sizes with every library, each
load after dropping the checkpoint files from the page cache, then once more with them in the
cache (warm). On S3 (a SeaweedFS server on 127.0.0.1, ``weed server -s3``), ``--s3-rounds``
rounds each save with ``storage``, with DCP's fsspec writer and with raw s3fs puts of the same
bytes as the same number of objects (the ceiling), then load into each of ``--s3-load-ranks``
world sizes the same way (raw: concurrent ranged GETs); the contenders' order rotates per round,
and the table gives medians, their spread and the per-round ratios. The async saves of ``storage``
are deferred (``defer_copy=True``, after one ``prepare_save``, as ``CheckpointManager`` does).
The raw sequential write (with fsync) and cold read bandwidth of the same disk,
measured in the same run, is the ceiling. Prints a table; ``--out FILE`` also writes it into the
"Checkpoint" section of FILE, ``--json FILE`` its numbers into the ``checkpoint`` entry of a JSON
results file (``ftsdp-report --bench`` charts it). All data lives in a temporary directory that
is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from ftsdp.testing import run_ranks
from ftsdp.tools import _bench_json
from ftsdp.tools import _bench_ranks as ranks
from ftsdp.tools._markdown import replace_section

GB = 1e9


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=250, help="state bytes across all ranks (MB)")
    p.add_argument("--dim", type=int, default=1024, help="model width (shapes of the state)")
    p.add_argument("--ranks", type=int, default=2, help="world size of the save")
    p.add_argument("--load-ranks", default="1,3", help="world sizes to load into, comma-separated")
    p.add_argument(
        "--backends", default="storage,dcp,s3", help="any of storage (local), dcp (local), s3"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="runs of each measurement (median), at least 2"
    )
    p.add_argument("--s3-rounds", type=int, default=5, help="rounds of the S3 contenders")
    p.add_argument("--s3-load-ranks", default="2,3", help="world sizes of the S3 loads")
    p.add_argument("--dir", default=None, help="parent of the temporary data directory")
    p.add_argument("--out", default=None, help="Markdown file whose Checkpoint section to write")
    p.add_argument("--json", default=None, help="JSON results file whose checkpoint entry to write")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned phase")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = set(args.backends) - {"storage", "dcp", "s3"}
    if bad:
        p.error(f"--backends: unknown {sorted(bad)}")
    args.load_ranks = [int(x) for x in args.load_ranks.split(",") if x.strip()]
    args.s3_load_ranks = [int(x) for x in args.s3_load_ranks.split(",") if x.strip()]
    if args.s3_rounds < 1:
        p.error("--s3-rounds must be >= 1")
    if args.repeats < 2:
        p.error("--repeats must be >= 2 (the first async save and the later ones are reported)")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All measurements: ``{key: [values...]}`` plus the raw disk figures and the state size."""
    shape_map = ranks.shapes(args.size_mb * 10**6, args.dim)
    nbytes = ranks.state_bytes(shape_map)
    parent = args.dir or tempfile.gettempdir()
    free = shutil.disk_usage(parent).free
    # every save stays until the end: 2 kinds x 2 libraries x repeats (+ raw), 3 x rounds on S3
    need = nbytes * (4 * args.repeats + 1 + 3 * (args.s3_rounds + 2))
    if free < need * 1.2:
        raise SystemExit(f"{parent}: {free / GB:.1f} GB free, the run needs ~{need / GB:.1f} GB")
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=parent)
    try:
        results: dict[str, Any] = {"bytes": nbytes}
        cfg: dict[str, Any] = {
            "shapes": shape_map,
            "bytes": nbytes,
            "root": root,
            "repeats": args.repeats,
            "backends": args.backends,
            "rounds": args.s3_rounds,
        }
        print(f"state: {nbytes / GB:.3f} GB in {len(shape_map)} params x 3; data in {root}")
        if {"storage", "dcp"} & set(args.backends):
            t0 = time.perf_counter()
            results["save"] = run_ranks(ranks.save_phase, args.ranks, cfg, timeout=args.timeout)[0]
            print(f"save phase done in {time.perf_counter() - t0:.0f}s")
            for w in args.load_ranks:
                t0 = time.perf_counter()
                results[f"load{w}"] = run_ranks(ranks.load_phase, w, cfg, timeout=args.timeout)[0]
                print(f"load phase {args.ranks} -> {w} done in {time.perf_counter() - t0:.0f}s")
        if "s3" in args.backends:
            results.update(run_s3(args, cfg))
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_s3(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """The S3 phases on a SeaweedFS server of their own: ``s3save`` and ``s3load<W>``."""
    import s3fs

    from ftsdp.testing import seaweedfs_server

    out = {}
    with seaweedfs_server(f"{cfg['root']}/seaweedfs") as options:
        s3fs.S3FileSystem(**options).mkdir("bench")
        cfg = {**cfg, "s3": {"url": "s3://bench/ckpt", "bucket": "bench", "options": options}}
        t0 = time.perf_counter()
        out["s3save"] = run_ranks(ranks.s3_save_phase, args.ranks, cfg, timeout=args.timeout)[0]
        print(f"S3 save phase done in {time.perf_counter() - t0:.0f}s")
        for w in args.s3_load_ranks:
            t0 = time.perf_counter()
            out[f"s3load{w}"] = run_ranks(ranks.s3_load_phase, w, cfg, timeout=args.timeout)[0]
            print(f"S3 load phase {args.ranks} -> {w} done in {time.perf_counter() - t0:.0f}s")
    return out


# -- the table --------------------------------------------------------------------------------------


Row = tuple[str, float | None, float | None, float | None, str, str]


def measurements(
    args: argparse.Namespace, res: dict[str, Any]
) -> tuple[list[Row], list[str], float | None, float | None]:
    """The table's rows ``(measurement, storage, DCP, S3, target, format)``, the verdict lines
    (MET / MISSED, with the reason) and the raw disk's write and read GB/s."""
    nbytes, save = res["bytes"], res["save"]

    def med(d: dict[str, list[float]], key: str, sl: slice = slice(None)) -> float | None:
        values = d.get(key, [])[sl]
        return statistics.median(values) if values else None

    def rate(seconds: float | None) -> float | None:
        return None if seconds is None else nbytes / seconds / GB

    def on_s3(phase: str, key: str) -> float | None:  # storage's median on SeaweedFS
        return med(res.get(phase, {}), key)

    raw_w, raw_r = med(save, "raw.write"), med(save, "raw.read")
    rows: list[Row] = []
    verdicts: list[str] = []

    def judge(what: str, ok: bool, detail: str, reason: str = "see the notes.") -> None:
        verdicts.append(
            f"- {what}: " + (f"MET ({detail})" if ok else f"MISSED ({detail}): {reason}")
        )

    st, dc = rate(med(save, "storage.save_s")), rate(med(save, "dcp.save_s"))
    s3_save = on_s3("s3save", "storage.save_gbps")
    rows.append(("save GB/s", st, dc, s3_save, ">= 1.5x DCP", ".2f"))
    if st and dc and raw_w:
        judge(
            "save >= 1.5x DCP",
            st >= 1.5 * dc,
            f"{st / dc:.2f}x",
            f"both libraries are bound by the disk (see the notes): 1.5x DCP is "
            f"{1.5 * dc:.2f} GB/s, and the raw sequential write of this disk in the same run "
            f"is {raw_w:.2f} GB/s (one stream; DCP reaches {dc / raw_w:.0%} of it with "
            f"{args.ranks} ranks writing at once).",
        )
    if st and raw_w:
        judge("save >= 80% of raw write", st >= 0.8 * raw_w, f"{st / raw_w:.0%} of raw write")
    for w in args.load_ranks:
        ld = res[f"load{w}"]
        st, dc = rate(med(ld, "storage.load_s")), rate(med(ld, "dcp.load_s"))
        name = f"{args.ranks} -> {w}"
        s3_load = on_s3(f"s3load{w}", "storage.load_gbps")
        rows.append((f"load {name} GB/s", st, dc, s3_load, ">= 1.5x DCP", ".2f"))
        if st and dc:
            reason = "see the notes."
            if raw_r and 1.5 * dc > raw_r:
                reason = (
                    f"both libraries are bound by the disk (see the notes): 1.5x DCP is "
                    f"{1.5 * dc:.2f} GB/s, above the raw sequential read of this disk in the same "
                    f"run ({raw_r:.2f} GB/s, one stream); storage reaches {st / raw_r:.0%} of it, "
                    f"DCP {dc / raw_r:.0%}."
                )
            judge(f"load {name} >= 1.5x DCP", st >= 1.5 * dc, f"{st / dc:.2f}x", reason)
        st, dc = rate(med(ld, "storage.warm_load_s")), rate(med(ld, "dcp.warm_load_s"))
        rows.append((f"load {name} GB/s, warm cache", st, dc, None, ">= 1.2x DCP", ".2f"))
        if st and dc:
            judge(f"load {name}, warm cache >= 1.2x DCP", st >= 1.2 * dc, f"{st / dc:.2f}x")
        rows.append(
            (
                f"bytes read / needed, {name} (library's reads)",
                med(ld, "storage.read_ratio"),
                med(ld, "dcp.read_ratio"),
                on_s3(f"s3load{w}", "storage.read_ratio"),
                "",
                ".3f",
            )
        )
        if w == 1:  # ranks of one machine share the page cache: one rank's read serves all
            rows.append(
                (
                    f"bytes read / needed, {name} (from the disk)",
                    med(ld, "storage.disk_ratio"),
                    med(ld, "dcp.disk_ratio"),
                    None,
                    "",
                    ".3f",
                )
            )
    first = (
        med(save, "storage.async_blocking_s", slice(0, 1)),
        med(save, "dcp.async_blocking_s", slice(0, 1)),
    )
    later = (
        med(save, "storage.async_blocking_s", slice(1, None)),
        med(save, "dcp.async_blocking_s", slice(1, None)),
    )
    rows.append(("async save: blocking s, first save", *first, None, "<= 0.1x DCP", ".4f"))
    rows.append(("async save: blocking s, later saves", *later, None, "<= 0.1x DCP", ".4f"))
    prep = med(save, "storage.prepare_s")
    rows.append(
        ("storage.saving.prepare_save s (once, before the first save)", prep, None, None, "", ".3f")
    )
    rows.append(
        (
            "async save: until committed s",
            med(save, "storage.async_total_s"),
            med(save, "dcp.async_total_s"),
            None,
            "",
            ".2f",
        )
    )
    for label, (st, dc) in (("later saves", later), ("first save", first)):
        if st and dc:
            judge(f"async blocking <= 0.1x DCP, {label}", st <= 0.1 * dc, f"{st / dc:.3f}x")
    return rows, verdicts, raw_w, raw_r


def table(args: argparse.Namespace, res: dict[str, Any]) -> tuple[str, list[str]]:
    """The Markdown table and the verdict lines (MET / MISSED, with the reason)."""
    rows, verdicts, raw_w, raw_r = measurements(args, res)

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [
        "| measurement | storage (local) | DCP (local) | storage / DCP | storage (S3, SeaweedFS) "
        "| target |",
        "|---|---|---|---|---|---|",
    ]
    for name, st, dc, s3v, target, spec in rows:
        ratio = f"{st / dc:.2f}x" if st and dc else "-"
        lines.append(
            f"| {name} | {fmt(st, spec)} | {fmt(dc, spec)} | {ratio} | {fmt(s3v, spec)} | {target} |"
        )
    lines.append(
        f"| raw disk GB/s: sequential write + fsync / read, page cache dropped | "
        f"{fmt(raw_w, '.2f')} / {fmt(raw_r, '.2f')} | | | | ceiling |"
    )
    return "\n".join(lines), verdicts


def s3_table(args: argparse.Namespace, res: dict[str, Any]) -> tuple[str, list[str], list[dict]]:
    """The S3 table (medians, min-max, per-round ratios), its verdicts and its rows as JSON."""

    def spread(xs: list[float], spec: str = ".3f", unit: str = "") -> str:
        if not xs:
            return "-"
        med = statistics.median(xs)
        return f"{med:{spec}}{unit} ({min(xs):{spec}}-{max(xs):{spec}})"

    lines = [
        "| S3 (SeaweedFS), GB/s | raw s3fs (ceiling) | storage | DCP fsspec | storage / raw, "
        "per round | storage / DCP, per round | target |",
        "|---|---|---|---|---|---|---|",
    ]
    verdicts, rows = [], []
    phases = [("s3save", "save", f"save, W={args.ranks}", ">= 0.9x raw")]
    phases += [  # the S3 load phases that ran, by world size
        (k, "load", f"load {args.ranks} -> {k[6:]}", ">= 0.9x raw, >= 1.5x DCP")
        for k in sorted((k for k in res if k.startswith("s3load")), key=lambda k: int(k[6:]))
    ]
    for phase, kind, name, target in phases:
        d = res.get(phase)
        if not d:
            continue
        raw, st, dc = (d.get(f"{lib}.{kind}_gbps", []) for lib in ranks.S3_CONTENDERS)
        vs_raw = [a / b for a, b in zip(st, raw, strict=True)]
        vs_dcp = [a / b for a, b in zip(st, dc, strict=True)]
        lines.append(
            f"| {name} | {spread(raw)} | {spread(st)} | {spread(dc)} | "
            f"{spread(vs_raw, '.2f', 'x')} | {spread(vs_dcp, '.2f', 'x')} | {target} |"
        )
        r_raw, r_dcp = statistics.median(vs_raw), statistics.median(vs_dcp)
        verdicts.append(
            f"- S3 {name} >= 0.9x raw: {'MET' if r_raw >= 0.9 else 'MISSED'} ({r_raw:.2f}x, "
            "median of the rounds' ratios)"
        )
        if kind == "load":
            verdicts.append(
                f"- S3 {name} >= 1.5x DCP: {'MET' if r_dcp >= 1.5 else 'MISSED'} ({r_dcp:.2f}x)"
            )
        rows.append({"measurement": f"S3 {name}", "raw": raw, "storage": st, "dcp": dc})
        if "storage.read_ratio" in d:
            ratio = d["storage.read_ratio"][0]
            lines.append(f"| bytes read / needed, {name} | | {ratio:.3f} | | | | |")
    return "\n".join(lines), verdicts, rows


def json_entry(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """The ``checkpoint`` entry of the JSON results: the table's rows (GB/s, ratios, seconds;
    null where not measured), the raw disk's GB/s, the S3 rounds (GB/s per round of each
    contender) and the verdicts."""
    rows, verdicts, raw_w, raw_r = (
        measurements(args, res) if "save" in res else ([], [], None, None)
    )
    _, s3_verdicts, s3_rows = s3_table(args, res)
    return {
        "bytes": res["bytes"],
        "ranks": args.ranks,
        "repeats": args.repeats,
        "rows": [
            {"measurement": name, "storage": st, "dcp": dc, "s3": s3v, "target": target}
            for name, st, dc, s3v, target, _ in rows
        ],
        "raw_disk_gbps": {"write": raw_w, "read": raw_r},
        "s3_rounds": s3_rows,
        "verdicts": verdicts + s3_verdicts,
    }


def write_section(path: str, text: str) -> None:
    """Replace (or append) the ``## Checkpoint`` section of the Markdown file ``path``."""
    replace_section(path, text, "## Checkpoint")


def environment() -> str:
    """What the numbers depend on besides the code: CPUs, their load, the checksum in use."""
    import torch

    from ftsdp import storage

    load = os.getloadavg()[0]
    return (
        f"torch {torch.__version__}, {os.cpu_count()} CPUs (1-minute load average {load:.1f} "
        "at the start: other work shares them), checksums CRC-32C (format version "
        f"{storage.format.FORMAT_VERSION}: the Shard(0) tensors described by their layout rule)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command = "python -m ftsdp.tools.bench_checkpoint " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    env = environment()
    res = run(args)
    date = datetime.date.today().isoformat()
    print(env)
    if "save" in res:
        tab, verdicts = table(args, res)
        print(tab)
        print("\n".join(verdicts))
        if args.out:
            body = (
                f"## Checkpoint\n\n`{command}` ({date}; median of {args.repeats} runs; "
                f"{res['bytes'] / GB:.3f} GB of state; {env})\n\n{tab}\n\n"
                + "\n".join(verdicts)
                + "\n"
            )
            write_section(args.out, body)
            print(f"wrote the Checkpoint section of {args.out}")
    if "s3save" in res:
        tab, verdicts, _ = s3_table(args, res)
        print(tab)
        print("\n".join(verdicts))
        if args.out:
            body = (
                f"## Checkpoint on S3\n\n`{command}` ({date}; {args.s3_rounds} rounds, the "
                f"order rotating; median (min-max); {res['bytes'] / GB:.3f} GB of state; "
                f"{env})\n\n{tab}\n\n" + "\n".join(verdicts) + "\n"
            )
            replace_section(args.out, body, "## Checkpoint on S3")
            print(f"wrote the Checkpoint on S3 section of {args.out}")
    if args.json:
        _bench_json.write_entry(args.json, "checkpoint", json_entry(args, res), command, env)
        print(f"wrote the checkpoint entry of {args.json}")


if __name__ == "__main__":
    main()
