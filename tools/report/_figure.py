"""The run report's figure on its own Agg canvas (no pyplot), its panels as named axes
(docs/report.md, "The page")."""

from __future__ import annotations

import itertools
from dataclasses import astuple
from typing import Any

from ftsdp.tools.report._records import FaultRow, Marker, Run, Source, saves, series, world_series

MARKER_COLORS = {"restart": "tab:red", "resize": "tab:purple", "preempted": "tab:orange"}
DOWN_COLOR = "tab:red"
EXTRA_HINT = "pip install 'ftsdp[report]'"
# The fault table's columns: FaultRow's first fields, in their order.
COLUMNS = (
    "run", "kind", "step", "detected by", "detection s", "to first new step s", "steps lost",
    "resumed from", "world",
)  # fmt: skip


class MissingExtraError(ImportError):
    """An optional dependency of the report (matplotlib) is not installed."""


def cell(value: Any) -> str:
    """A table cell: a float with two decimals, None as ``-``."""
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def fault_columns(rows: list[FaultRow], several_runs: bool) -> tuple[list[str], list[list[str]]]:
    """The fault table's header and cells (the figure's table and the HTML table)."""
    first = 0 if several_runs else 1  # the run column only when there are several
    cells = [[cell(v) for v in astuple(r)[first : len(COLUMNS)]] for r in rows]
    return list(COLUMNS[first:]), cells


def fault_origin(rows: list[FaultRow]) -> str:
    """What the table's times count from, in words."""
    origins = {r.origin for r in rows}
    if origins == {"fault log"}:
        return "times from the injected fault (fault log)"
    if origins == {"last record"}:
        return "times from the last record before detection (no fault log given: lower bounds)"
    return "times from the injected fault where the fault log has it, else the last record"


GAP_IN = 0.8  # inches between panel rows: titles, tick labels, axis labels
TOP_IN, BOTTOM_IN = 0.65, 0.45


def figure_grid(heights: list[float], dpi: int, title: str, **grid: Any) -> tuple[Any, Any]:
    """A titled figure whose panel rows are ``heights`` inches tall, and its 2-column grid; a
    fixed layout, as constrained layout draws every figure twice to measure it."""
    try:  # imported here: the report's optional dependency
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError(
            f"the report needs matplotlib, which is not installed: {EXTRA_HINT}"
        ) from None
    total = sum(heights) + GAP_IN * (len(heights) - 1) + TOP_IN + BOTTOM_IN
    fig = Figure(figsize=(11.0, total), dpi=dpi)
    FigureCanvasAgg(fig)  # its own canvas: no pyplot
    fig.suptitle(title, fontsize=11, y=1 - 0.1 / total, va="top")
    spec = fig.add_gridspec(
        len(heights),
        2,
        height_ratios=heights,
        left=0.075,
        right=0.985,
        top=1 - TOP_IN / total,
        bottom=BOTTOM_IN / total,
        hspace=GAP_IN / (sum(heights) / len(heights)),
        **{"wspace": 0.2, **grid},
    )
    return fig, spec


def save_slots(
    per_source: list[list[tuple[int, float]]], i: int
) -> tuple[list[float], list[float]]:
    """Bar centres and widths of source ``i``'s saves: each step's slot split between the
    sources, a source's share split again between its saves of one step."""
    steps = sorted({step for points in per_source for step, _ in points})
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    slot = 0.8 * min(gaps, default=1)
    share = slot / len(per_source)
    left = -slot / 2 + i * share
    mine = [step for step, _ in per_source[i]]
    xs, widths = [], []
    for j, step in enumerate(mine):
        k = mine[:j].count(step)  # its saves of this step before this one
        width = share / mine.count(step)
        xs.append(step + left + (k + 0.5) * width)
        widths.append(width)
    return xs, widths


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def run_figure(
    runs: list[Run],
    sources: list[Source],
    markers: list[Marker],
    rows: list[FaultRow],
    suite: list[dict[str, Any]],
    title: str,
    dpi: int = 80,
) -> tuple[Any, dict[str, Any]]:
    """The figure and its named axes (docs/report.md, "The page")."""
    metric_sources = [s for s in sources if s.events]
    heights: list[float] = []
    if runs:
        heights += [3.0, 2.2, 2.2, 0.1 + 0.22 * (1 + max(1, len(rows)))]
    if suite:
        heights.append(0.4 + 0.45 * len(suite))
    fig, grid = figure_grid(heights, dpi, title)
    from matplotlib import transforms  # after figure_grid: it says when matplotlib is missing
    from matplotlib.lines import Line2D

    axes: dict[str, Any] = {}
    # each file's color and legend label, the same in every panel
    style = {
        s.path: {"color": f"C{i % 10}", "label": s.label} for i, s in enumerate(metric_sources)
    }
    run_of = {s.path: run for run in runs for s in run.sources}
    if runs:
        loss = axes["loss"] = fig.add_subplot(grid[0, :])
        tps = axes["tokens_per_s"] = fig.add_subplot(grid[1, 0])
        sps = axes["s_per_step"] = fig.add_subplot(grid[1, 1], sharex=tps)
        world = axes["world_size"] = fig.add_subplot(grid[2, 0], sharex=tps)
        ckpt = axes["checkpoint"] = fig.add_subplot(grid[2, 1])
        table = axes["faults"] = fig.add_subplot(grid[3, :])
        handles = []
        for s in metric_sources:
            t0 = run_of[s.path].t0
            handles += loss.plot(*series(s, t0, "loss", by="step"), lw=1.2, **style[s.path])
            tps.plot(*series(s, t0, "tokens_per_s"), lw=1.0, **style[s.path])
            sps.plot(*series(s, t0, "s_per_step"), lw=1.0, **style[s.path])
            world.plot(*world_series(s, t0), lw=1.2, drawstyle="steps-post", **style[s.path])
        for i, m in enumerate(markers):
            k = [n.step for n in markers[:i]].count(m.step)  # markers before it at its step
            color = MARKER_COLORS[m.kind]
            loss.axvline(
                m.step, color=color, ls="--", lw=1.0, gid=f"marker:{m.kind}", label=m.label
            )
            where = transforms.offset_copy(  # markers at one step side by side
                transforms.blended_transform_factory(loss.transData, loss.transAxes),
                fig=fig, x=-5 + 10 * k, units="points",
            )  # fmt: skip
            loss.text(
                m.step, 0.97, m.label, transform=where, rotation=90, va="top", ha="center",
                fontsize=7, color=color,
            )  # fmt: skip
        kinds = [k for k in MARKER_COLORS if any(m.kind == k for m in markers)]
        handles += [Line2D([], [], color=MARKER_COLORS[k], ls="--", lw=1.0, label=k) for k in kinds]
        loss.set(title="loss", xlabel="step", ylabel="loss")
        if handles:
            loss.legend(handles=handles, fontsize=8, loc="upper right")
        else:
            _empty(loss, "no step records")
        several = len(runs) > 1
        for r in rows:
            t0 = next(run.t0 for run in runs if run.label == r.run)
            for ax in (tps, sps, world):
                if r.back_time is not None:
                    ax.axvspan(
                        r.fault_time - t0, r.back_time - t0, color=DOWN_COLOR, alpha=0.12, lw=0
                    )
                else:
                    ax.axvline(r.fault_time - t0, color=DOWN_COLOR, lw=1.0, ls=":", gid="fault")
        xlabel = "seconds since the run's first record" + (" (each run its own)" if several else "")
        tps.set(
            title="tokens/s (shaded: fault to first new step)", xlabel=xlabel, ylabel="tokens/s"
        )
        sps.set(title="seconds per step", xlabel=xlabel, ylabel="s/step")
        world.set(title="world size", xlabel=xlabel, ylabel="ranks")
        world.yaxis.get_major_locator().set_params(integer=True)
        sizes = [y for ln in world.lines if not ln.get_gid() for y in ln.get_ydata() if y == y]
        world.set_ylim(0, max(sizes, default=1) + 1)
        for ax in (tps, sps, world):
            if not ax.lines:
                _empty(ax, "no records")
        with_saves = [(s, saves(s)) for s in metric_sources if saves(s)]
        for i, (s, points) in enumerate(with_saves):
            xs, widths = save_slots([p for _, p in with_saves], i)
            ckpt.bar(xs, [b for _, b in points], width=widths, alpha=0.8, **style[s.path])
        if len(with_saves) > 1:
            ckpt.legend(fontsize=7)
        saved = sorted({step for _, points in with_saves for step, _ in points})
        if 0 < len(saved) <= 16:  # a tick per saved step
            ckpt.set_xticks(saved, [str(x) for x in saved], fontsize=8)
        ckpt.set(title="checkpoint: blocking seconds per save", xlabel="step", ylabel="s")
        if not with_saves:
            _empty(ckpt, "no checkpoint records")
        table.axis("off")
        if rows:
            header, cells = fault_columns(rows, several)
            t = table.table(cellText=cells, colLabels=header, loc="upper center", cellLoc="center")
            t.auto_set_font_size(False)
            t.set_fontsize(8)
            t.auto_set_column_width(list(range(len(header))))
            table.set_title(f"faults: {len(rows)} ({fault_origin(rows)})", fontsize=10)
        else:
            table.set_title("faults: none (every incarnation ended with done)", fontsize=10)
    if suite:  # room on the left for the scenarios' names
        room = grid[4 if runs else 0, :].subgridspec(1, 2, width_ratios=[0.3, 0.7])
        axes["recovery"] = recovery_axes(fig.add_subplot(room[0, 1]), suite)
    return fig, axes


def recovery_axes(ax: Any, suite: list[dict[str, Any]]) -> Any:
    """The fault suite's rows as horizontal bars per scenario (docs/report.md, "recovery")."""
    ys = list(range(len(suite)))
    detection = [float(r["detection_s"] or 0.0) for r in suite]
    back = [float(r["fault_to_first_new_step_s"] or 0.0) for r in suite]
    ax.barh([y - 0.2 for y in ys], detection, height=0.38, color="tab:orange", label="detection")
    ax.barh(
        [y + 0.2 for y in ys], back, height=0.38, color="tab:blue", label="fault → first new step"
    )
    for y, r, d, b in zip(ys, suite, detection, back, strict=True):
        how = r.get("detected_by") or "?"
        note = (
            f"{r.get('world_sizes', '')}, {how}, lost {r.get('steps_lost')}, "
            f"from step {r.get('resumed_step')}"
        )
        ax.text(max(d, b) + 0.15, y, note, va="center", fontsize=7, color="0.25")
    ax.set_yticks(ys, [str(r["scenario"]) for r in suite], fontsize=7)
    ax.invert_yaxis()
    ax.set_title("fault suite: recovery per scenario", loc="left")
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max([*back, *detection, 1.0]) * 1.6)
    ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1, 1), ncol=2, frameon=False)
    return ax
