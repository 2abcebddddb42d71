"""``ftsdp-report --bench FILE.json``: the benchmarks' JSON results (``tools/_bench_json.py``) as
bar charts, one panel (a key of ``axes``) per drawing function (docs/report.md, "Benchmark charts")."""

from __future__ import annotations

import json
from typing import Any

from ftsdp.tools.report._figure import figure_grid

MB = 1e6
LIBRARIES = (
    ("storage", "storage (local)"),
    ("dcp", "DCP (local)"),
    ("s3", "storage (S3, SeaweedFS)"),
)
HELD = (("params", "parameters"), ("optim", "AdamW state"))


class BenchFileError(ValueError):
    """The ``--bench`` file is not the benchmarks' JSON results."""


def read_bench(path: str) -> dict[str, Any]:
    """The results file's entries; :class:`BenchFileError` (naming the file and what is wrong)
    when it is not a JSON object with at least one of ``engine``, ``checkpoint``, ``checksum``."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise BenchFileError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not any(k in data for k in ENTRIES):
        raise BenchFileError(
            f"{path} holds no benchmark entry ({', '.join(ENTRIES)}); write one with "
            "python -m ftsdp.tools.bench_engine --json FILE (or bench_checkpoint, bench_checksum)"
        )
    return data


def _grouped(ax: Any, groups: list[str], series: dict[str, list[float | None]], **kw: Any) -> None:
    """Bars of each series side by side within each group; a missing value draws no bar."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        pairs = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        ax.bar([x for x, _ in pairs], [v for _, v in pairs], width=width, label=name, **kw)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)


def engine_time(ax: Any, entry: dict[str, Any]) -> None:
    """Median step time per engine, grouped by run; the IQR as error bars."""
    runs = entry["runs"]
    engines = list(dict.fromkeys(e for r in runs for e in r["engines"]))
    groups = [r["label"] for r in runs]
    n = max(1, len(engines))
    width = 0.8 / n
    for i, e in enumerate(engines):
        rows = [(g, r["engines"][e]) for g, r in enumerate(runs) if e in r["engines"]]
        xs = [g + (i - (n - 1) / 2) * width for g, _ in rows]
        med = [v["step_ms"] for _, v in rows]
        err = [
            [m - v["step_ms_iqr"][0] for m, (_, v) in zip(med, rows, strict=True)],
            [v["step_ms_iqr"][1] - m for m, (_, v) in zip(med, rows, strict=True)],
        ]
        ax.bar(xs, med, width=width, yerr=err, capsize=2, label=e, error_kw={"lw": 0.8})
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set(title="engine: step time (median; IQR)", ylabel="ms per step")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=3, loc="upper left")


def memory_parts(mem: dict[str, Any]) -> dict[str, float]:
    """The stacked bar of one engine's peak, in bytes: parts held at the step's start, then the
    roles above it, then what the breakdown left unattributed; the parts sum to the peak."""
    parts = {name: float(mem[key]) for key, name in HELD}
    parts["other held at start"] = max(0.0, mem["start"] - sum(parts.values()))
    above = mem["peak_fwd_bwd"] - mem["start"]
    for role, nbytes in sorted(mem.get("above_start_by_role", {}).items(), key=lambda kv: -kv[1]):
        parts[f"peak: {role}"] = float(nbytes)
    attributed = sum(mem.get("above_start_by_role", {}).values())
    parts["peak: not attributed"] = max(0.0, above - attributed)
    return parts


def engine_memory(ax: Any, entry: dict[str, Any]) -> None:
    """A stacked bar per run and engine (:func:`memory_parts`) and a tick at the ZeRO target."""
    bars = [
        (f"{r['label'].split()[0]}\n" + e.replace("+", "\n+"), v["memory"])
        for r in entry["runs"]
        for e, v in r["engines"].items()
    ]
    stacks = [memory_parts(m) for _, m in bars]
    names = list(dict.fromkeys(k for s in stacks for k in s))
    bottom = [0.0] * len(bars)
    for name in names:
        heights = [s.get(name, 0.0) / MB for s in stacks]
        if not any(heights):
            continue
        ax.bar(range(len(bars)), heights, bottom=bottom, width=0.7, label=name)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    zero = [m["zero_target"] / MB for _, m in bars]
    label = "ZeRO: 16ψ/W + largest unit"
    ax.scatter(range(len(bars)), zero, marker="_", s=300, color="black", zorder=3, label=label)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=7)
    ax.set(title="engine: model-state peak (fwd + bwd) by role", ylabel="MB per rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _rows(entry: dict[str, Any], test: Any) -> list[dict[str, Any]]:
    return [r for r in entry["rows"] if test(r["measurement"])]


def checkpoint_throughput(ax: Any, entry: dict[str, Any]) -> None:
    """GB/s of each save and load row, one bar per library."""
    rows = _rows(entry, lambda m: m.endswith("GB/s"))
    groups = [r["measurement"].replace(" GB/s", "") for r in rows]
    present = [(k, name) for k, name in LIBRARIES if any(r.get(k) is not None for r in rows)]
    _grouped(ax, groups, {name: [r.get(k) for r in rows] for k, name in present})
    ax.set(title="checkpoint: throughput", ylabel="GB/s")
    ax.legend(fontsize=7)


def checkpoint_async(ax: Any, entry: dict[str, Any]) -> None:
    """The async save rows (seconds), storage against DCP."""
    rows = _rows(entry, lambda m: m.startswith("async save"))
    groups = [r["measurement"].replace("async save: ", "").replace(" s,", ",") for r in rows]
    groups = [g.removesuffix(" s") for g in groups]
    _grouped(ax, groups, {name: [r.get(k) for r in rows] for k, name in LIBRARIES[:2]})
    ax.set(title="checkpoint: async save", ylabel="seconds")
    ax.legend(fontsize=7)


def checksums(ax: Any, entry: dict[str, Any]) -> None:
    """GB/s of each checksum and of verify, warm and cold."""
    rates = dict(entry["rates_gbps"])
    rates["storage.catalog.verify, warm"] = entry["verify_warm_gbps"]
    if entry.get("verify_warm_one_cpu_gbps") is not None:
        rates["storage.catalog.verify, warm, one CPU"] = entry["verify_warm_one_cpu_gbps"]
    if entry.get("verify_cold_gbps") is not None:
        rates["storage.catalog.verify, cold"] = entry["verify_cold_gbps"]
    names = list(rates)
    ax.barh(range(len(names)), [rates[n] for n in names], color="tab:green")
    for y, name in enumerate(names):  # the names beside the bars: they are long
        ax.text(rates[name], y, f" {name}: {rates[name]:.2f}", va="center", fontsize=7)
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlim(0, max(rates.values()) * 1.9)
    ax.set(title="checksums and verify", xlabel="GB/s")


ENTRIES = {
    "engine": (engine_time, engine_memory),
    "checkpoint": (checkpoint_throughput, checkpoint_async),
    "checksum": (checksums,),
}


def bench_figure(data: dict[str, Any], title: str, dpi: int = 80) -> tuple[Any, dict[str, Any]]:
    """The bar charts of the entries in ``data`` and the ``sources`` footer; (figure, axes).

    Rows: the engine's memory (wide: one bar per run and engine, the legend beside it); the
    engine's step time and the checksums; the checkpoint's throughput and async save."""
    present = [k for k in ENTRIES if k in data]
    rows: list[list[Any]] = []
    if "engine" in data:
        rows.append([engine_memory])
        rows.append([engine_time, checksums if "checksum" in data else None])
    elif "checksum" in data:
        rows.append([checksums, None])
    if "checkpoint" in data:
        rows.append([checkpoint_throughput, checkpoint_async])
    fig, grid = figure_grid([3.0] * len(rows) + [0.15 * len(present)], dpi, title, wspace=0.25)
    entry_of = {draw: key for key, draws in ENTRIES.items() for draw in draws}
    axes: dict[str, Any] = {}
    for i, panels in enumerate(rows):
        for j, draw in enumerate(panels):
            if draw is None:
                continue
            if len(panels) == 1:  # wide, with room on the right for its legend
                cell = grid[i, :].subgridspec(1, 2, width_ratios=[0.72, 0.28])[0, 0]
            else:
                cell = grid[i, j]
            ax = axes[draw.__name__] = fig.add_subplot(cell)
            draw(ax, data[entry_of[draw]])
    sources = axes["sources"] = fig.add_subplot(grid[len(rows), :])
    sources.axis("off")
    lines = [f"{k}: {data[k]['command']}   ({data[k].get('date', '?')})" for k in present]
    sources.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=7, family="monospace")
    return fig, axes
