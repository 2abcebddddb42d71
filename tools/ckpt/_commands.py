"""The subcommands: each calls one ``storage`` function and prints its result."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

from ftsdp import storage
from ftsdp.tools.ckpt._args import human_bytes, printable, progress_for
from ftsdp.tools.ckpt._hf_export import hf_export


def _emit(out: TextIO, obj: Any) -> None:
    """``obj`` as strict JSON: a float that JSON cannot hold (NaN, an infinity) is written as
    the string Python's ``json`` would have written bare ("NaN", "Infinity", "-Infinity")."""
    out.write(json.dumps(_strict(obj), indent=2, sort_keys=True, default=str, allow_nan=False))
    out.write("\n")


def _strict(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return json.dumps(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _with_progress(args: argparse.Namespace, fn: Callable[..., Any], **kwargs: Any) -> Any:
    """``fn(**kwargs)`` with the common options, and a progress bar named after the command."""
    bar = progress_for(args.command, not args.quiet)
    common = {"max_memory": args.max_memory, "storage_options": args.storage_options}
    try:
        return fn(progress=bar, trust_pickle=args.trust_pickle, **common, **kwargs)
    finally:
        if bar is not None:
            bar.close()


def _groups(tensors: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Tensors by the first part of their name (the trainer's ``model.``, ``optim.``): count,
    bytes and dtype counts, in name order."""
    groups: dict[str, dict[str, Any]] = {}
    for t in tensors:
        group = groups.setdefault(
            printable(t["name"].split(".", 1)[0]), {"tensors": 0, "bytes": 0, "dtypes": Counter()}
        )
        group["tensors"] += 1
        group["bytes"] += t["bytes"]
        group["dtypes"][printable(t["dtype"])] += 1
    return groups


def _sizes(cuts: list[int]) -> str:
    """The cell sizes along one dim: ``"2"`` when equal, else ``"3|2"``."""
    sizes = [b - a for a, b in itertools.pairwise(cuts)] or [0]
    return str(sizes[0]) if len(set(sizes)) == 1 else "|".join(map(str, sizes))


def layout_text(layout: dict[str, Any] | None) -> str:
    """One tensor's saved layout in a few words: ``grid 2x2, cells 3|2 x 4|3``, ``even rule
    (chunk 6)``, ``writer rule (rank 0)``, ``3 pieces`` (``""`` for no layout)."""
    if not layout:
        return ""
    parts = []
    if "grid" in layout:
        cells = "x".join(map(str, layout["cells"]))
        parts.append(f"grid {cells}, cells {' x '.join(_sizes(c) for c in layout['grid'])}")
    rule = layout.get("rule")
    if rule is not None:
        args = (
            f"chunk {rule.get('chunk')}, start {rule.get('start')}"
            if rule.get("start")
            else f"chunk {rule.get('chunk')}"
            if rule["kind"] == "even"
            else f"rank {rule.get('writer')}"
        )
        parts.append(f"{printable(rule['kind'])} rule ({args})")
    if "pieces" in layout:
        n = layout["pieces"]
        parts.append(f"{n} piece{'' if n == 1 else 's'}")
    return ", ".join(parts)


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    info = storage.catalog.inspect_checkpoint(
        args.url, args.step, storage_options=args.storage_options, trust_pickle=args.trust_pickle
    )
    if args.json:
        _emit(out, info)
        return 0
    out.write(f"{info['format']} checkpoint {printable(info['url'])}\n")
    if info["format"] == "ftsdp":
        out.write(f"committed steps: {info['committed_steps'] or 'none'}\n")
        out.write(f"torn steps: {info['torn_steps'] or 'none'}\n")
        if info["step"] is None:
            return 0
        out.write(f"step {info['step']}, saved at world size {info['world_size']}\n")
    groups = _groups(info["tensors"])
    width = max([len(g) for g in groups] + [5])
    for name, g in groups.items():
        counts = sorted(g["dtypes"].items(), key=lambda kv: (-kv[1], kv[0]))  # most, then a-z
        dtypes = ", ".join(f"{d} {n}" for d, n in counts)
        out.write(
            f"{name:<{width}}  {g['tensors']:>6} tensors {human_bytes(g['bytes']):>11}  {dtypes}\n"
        )
    out.write(
        f"total: {info['total_tensors']} tensors, {human_bytes(info['total_bytes'])} ({info['total_bytes']} bytes)\n"
    )
    out.write(f"values: {printable(', '.join(info['values'])) or 'none'}\n")
    for d in info.get("dropped", []):
        out.write(f"not representable: {printable(d)}\n")
    layouts = [t["layout"] for t in info["tensors"] if "layout" in t]
    if layouts:  # ftsdp: how the tensors were saved
        grid = sum("grid" in lay for lay in layouts)
        rule = sum("rule" in lay for lay in layouts)
        out.write(
            f"layouts: {grid} on a grid (N-D shards), {len(layouts) - grid} row-major; "
            f"{rule} by a layout rule, {len(layouts) - rule} listing their pieces\n"
        )
    if not args.tensors:
        if info["tensors"]:
            what = "shape, dtype, bytes and layout" if layouts else "shape, dtype and bytes"
            out.write(f"every tensor's name, {what}: --tensors\n")
        return 0
    names = [printable(t["name"]) for t in info["tensors"]]
    width = max([len(n) for n in names] + [4])
    head = f"{'name':<{width}}  {'shape':<20} {'dtype':<14} {'bytes':>12}"
    out.write(f"\n{head}  layout\n" if layouts else f"\n{head}\n")
    for name, t in zip(names, info["tensors"], strict=True):
        row = f"{name:<{width}}  {t['shape']!s:<20} {printable(t['dtype']):<14} {t['bytes']:>12}"
        lay = layout_text(t.get("layout"))
        out.write(f"{row}  {lay}\n" if lay else f"{row}\n")
    return 0


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    report = _with_progress(args, storage.catalog.verify, url=args.url, step=args.step)
    if args.json:
        _emit(out, {**report.__dict__, "ok": report.ok})
        return 0 if report.ok else 1
    for problem in report.problems:
        out.write(f"PROBLEM: {printable(problem)}\n")
    for step in report.removed:  # retention or gc took it meanwhile: not a problem
        out.write(f"step {step}: removed while checking (retention or gc)\n")
    steps = ", ".join("all" if s is None else str(s) for s in report.checked) or "none"
    torn = f"; torn steps (ignored by readers): {report.torn_steps}" if report.torn_steps else ""
    verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    out.write(
        f"{verdict}: {report.format} {printable(report.url)} step(s) {steps}, {human_bytes(report.bytes_read)} read{torn}\n"
    )
    return 0 if report.ok else 1


def _convert_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    options = ("step", "dst_step", "dtype", "model_only", "rename", "overwrite")
    return {name: getattr(args, name) for name in options}


def _report_convert(result: storage.conversion.ConvertResult, out: TextIO) -> None:
    where = (
        f" step {result.step} for world size {result.world_size}" if result.step is not None else ""
    )
    if result.mesh is not None:
        where += f" (a {'x'.join(map(str, result.mesh))} mesh)"
    read = "" if result.source_step is None else f" (step {result.source_step})"
    out.write(
        f"wrote {result.dest_format}{where}: {result.tensors} tensors, "
        f"{human_bytes(result.bytes_read)} from a {result.source_format} checkpoint{read}\n"
    )
    for path in result.written:
        out.write(f"  {printable(path)}\n")
    for d in result.dropped:
        out.write(f"dropped: {printable(d)}\n")


def cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    kwargs, notes = _convert_kwargs(args), None
    if args.to == "hf":  # a Hugging Face model folder (see _hf_export.py, docs/cli.md)
        export, notes = hf_export(args)
        kwargs.update(export)
    result = _with_progress(
        args, storage.conversion.convert, src=args.src, dst=args.dst, to=args.to,
        src_format=args.src_format, world_size=args.world_size, mesh=args.mesh,
        placements=args.placement, max_shard_bytes=args.max_shard_size, **kwargs,
    )  # fmt: skip
    _report_convert(result, out)
    for line in notes(result) if notes else []:  # the files copied, and notes
        out.write(f"{printable(line)}\n")
    return 0


def cmd_reshard(args: argparse.Namespace, out: TextIO) -> int:
    result = _with_progress(
        args, storage.conversion.reshard, src=args.src, dst=args.dst, world_size=args.world_size,
        mesh=args.mesh, placements=args.placement, **_convert_kwargs(args),
    )  # fmt: skip
    _report_convert(result, out)
    return 0


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    result = _with_progress(
        args, storage.catalog.diff, url_a=args.url, step_a=args.step_a, url_b=args.url,
        step_b=args.step_b,
    )  # fmt: skip
    if args.json:
        _emit(out, result)
        return 0
    counts = Counter(row["status"] for row in result["tensors"])
    for row in result["tensors"]:
        if row["status"] == "same":
            continue
        detail = ""
        if "max_abs_diff" in row:
            detail = (
                f"{row['changed']}/{row['numel']} elements, max abs diff {row['max_abs_diff']:.6g}"
            )
        elif row["status"] == "shape":
            detail = f"{row['a']} -> {row['b']}"
        out.write(f"{row['status']:<8} {printable(row['name'])} {detail}\n")
    for v in result["values"]:
        out.write(f"value    {printable(v['name'])}: {v['a']!r} -> {v['b']!r}\n")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no tensors"
    out.write(
        f"step {args.step_a} -> {args.step_b}: {summary}; {len(result['values'])} values differ\n"
    )
    return 0


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    report = storage.catalog.collect_garbage(
        args.url, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run,
        grace_s=args.grace_s, storage_options=args.storage_options,
    )  # fmt: skip
    verb = "would remove" if report.dry_run else "removed"
    for path in report.removed_paths:
        out.write(f"{verb} {printable(path)}\n")
    for why in report.left_alone:  # not provably this format's: never deleted
        out.write(f"left alone: {printable(why)}\n")
    for why in report.failed:
        out.write(f"FAILED: {printable(why)}\n")
    for step in report.removed_elsewhere:  # its manifest vanished while gc read it
        where = printable(f"{report.url}/step-{step}")
        out.write(f"removed by someone else meanwhile (another gc or a job's retention): {where}\n")
    out.write(
        f"{verb} steps {report.removed_steps or 'none'} and {len(report.removed_paths)} paths, "
        f"{human_bytes(report.bytes)}; kept steps {report.kept_steps or 'none'}\n"
    )
    if report.in_progress:
        out.write(
            f"kept torn steps {report.in_progress}: newer than the newest commit or written "
            f"less than {args.grace_s:g} s ago (a save may be running)\n"
        )
    return 1 if report.failed else 0


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "convert": cmd_convert,
    "reshard": cmd_reshard,
    "diff": cmd_diff,
    "gc": cmd_gc,
}
