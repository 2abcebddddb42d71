"""``ftsdp-report``: a run's metrics, fault logs and the fault suite's report as one page of
plots (HTML or PNG); the benchmarks' JSON results as bar charts. docs/report.md says more."""

from __future__ import annotations

import argparse
import base64
import html
import io
import logging
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ftsdp.tools.report._bench import BenchFileError, bench_figure, read_bench
from ftsdp.tools.report._figure import (
    MissingExtraError,
    cell,
    fault_columns,
    fault_origin,
    run_figure,
)
from ftsdp.tools.report._records import (
    FaultRow,
    Marker,
    Run,
    Skipped,
    fault_rows,
    group_runs,
    markers,
    read_source,
    summarise,
)

__all__ = [
    "BenchFileError",
    "FaultRow",
    "Marker",
    "MissingExtraError",
    "Report",
    "Skipped",
    "build_bench",
    "build_report",
    "main",
]

PROG = "ftsdp-report"
EXIT_OK, EXIT_USAGE = 0, 2
logger = logging.getLogger(__name__)


class NothingToPlotError(ValueError):
    """No input file held a record the report can use."""


@dataclass
class Report:
    """A built report: the ``figure``, its panels by name (``axes``), the fault table's rows, the
    restart markers, the fault suite's rows (``suite``) and the input lines ``skipped``."""

    figure: Any
    axes: dict[str, Any]
    title: str
    inputs: list[str]
    faults: list[FaultRow] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    suite: list[dict[str, Any]] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def skipped_summary(self) -> str:
        """One line per input file with skipped lines (empty when none were)."""
        return summarise(self.skipped)

    def png(self) -> bytes:
        """The figure as PNG bytes (at the figure's dpi)."""
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png")
        return buf.getvalue()

    def html(self) -> str:
        """One self-contained HTML page: the figure (an embedded PNG) and the tables as text."""
        png = base64.b64encode(self.png()).decode("ascii")
        esc = html.escape
        parts = [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{esc(self.title)}</title>",
            "<style>body{font-family:sans-serif;margin:1.5em;max-width:1100px}"
            "table{border-collapse:collapse;font-size:0.9em}"
            "td,th{border:1px solid #bbb;padding:0.2em 0.6em;text-align:right}"
            "th{background:#eee}td:first-child,th:first-child{text-align:left}"
            "img{max-width:100%}</style></head><body>",
            f"<h1>{esc(self.title)}</h1>",
            "<p>Inputs: " + ", ".join(f"<code>{esc(p)}</code>" for p in self.inputs) + "</p>",
            f'<img alt="{esc(self.title)}" src="data:image/png;base64,{png}">',
        ]
        if self.runs:
            parts.append(f"<h2>Faults ({len(self.faults)})</h2>")
            if self.faults:
                header, cells = fault_columns(self.faults, len(self.runs) > 1)
                parts += [f"<p>{esc(fault_origin(self.faults))}</p>", _table(header, cells)]
            else:
                parts.append("<p>None: every incarnation ended with <code>done</code>.</p>")
        if self.suite:
            keys = [k for k in self.suite[0] if not k.startswith("_")]
            parts.append("<h2>Fault suite</h2>")
            parts.append(_table(keys, [[cell(r.get(k)) for k in keys] for r in self.suite]))
        if self.skipped:
            items = [f"<li>{esc(line)}</li>" for line in self.skipped_summary().splitlines()]
            parts += [f"<h2>Skipped lines ({len(self.skipped)})</h2><ul>", *items, "</ul>"]
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"

    def save(self, path: str) -> None:
        """Write the report to ``path``: ``.html``/``.htm`` the page, ``.png`` the figure."""
        data = self.png() if output_kind(path) == "png" else self.html().encode("utf-8")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def _table(header: list[str], cells: list[list[str]]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in cells)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def output_kind(path: str) -> str:
    """``html`` or ``png`` from the output path's suffix; ValueError otherwise."""
    kinds = {".html": "html", ".htm": "html", ".png": "png"}
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in kinds:
        raise ValueError(f"-o {path}: the output must end in .html or .png")
    return kinds[suffix]


def build_report(
    paths: Sequence[str | os.PathLike[str]],
    *,
    title: str | None = None,
    dpi: int = 80,
    warn_skipped: bool = True,
) -> Report:
    """Read the JSONL files at ``paths`` and build the report's figure.

    Unusable lines are listed in ``Report.skipped`` (with ``warn_skipped``, also logged as one
    WARNING). Raises OSError for an unreadable file, :class:`NothingToPlotError` when no file holds
    a usable record, :class:`MissingExtraError` without matplotlib."""
    names = [os.fspath(p) for p in paths]
    if not names:
        raise NothingToPlotError("no input files: give one or more metrics JSONL files")
    base = {n: os.path.basename(n) for n in names}
    seen = Counter(os.path.basename(n) for n in names)  # a file given twice counts twice
    labels = {  # each file's legend label: its name, or enough of its path to tell it apart
        n: f"{os.path.basename(os.path.dirname(os.path.abspath(n)))}/{b}" if seen[b] > 1 else b
        for n, b in base.items()
    }
    read = [read_source(name, labels[name]) for name in names]
    sources = [source for source, _ in read]
    skipped = [s for _, lost in read for s in lost]
    if not any(s.events or s.suite for s in sources):
        raise NothingToPlotError(
            f"nothing to plot in {', '.join(names)}: no ftsdp.train --metrics record and no "
            "fault-suite report row" + (f" ({summarise(skipped)})" if skipped else "")
        )
    if skipped and warn_skipped:
        logger.warning("%s", summarise(skipped))
    runs = group_runs(sources)
    marks = [m for run in runs for m in markers(run)]
    rows = [r for run in runs for r in fault_rows(run)]
    suite = [r for s in sources for r in s.suite]
    if runs:
        title = title or "ftsdp run report: " + ", ".join(r.label for r in runs)
    title = title or f"ftsdp fault suite: {len(suite)} scenarios"
    figure, axes = run_figure(runs, sources, marks, rows, suite, title, dpi=dpi)
    return Report(figure, axes, title, names, rows, marks, suite, runs, skipped)


def build_bench(path: str | os.PathLike[str], *, title: str | None = None, dpi: int = 80) -> Report:
    """The bar charts of the benchmarks' JSON results at ``path`` (see ``_bench``)."""
    name = os.fspath(path)
    data = read_bench(name)
    title = title or f"ftsdp benchmarks ({os.path.basename(name)})"
    figure, axes = bench_figure(data, title, dpi=dpi)
    return Report(figure=figure, axes=axes, title=title, inputs=[name])


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; argparse exits with status 2 on a usage error."""
    from ftsdp import __version__

    p = argparse.ArgumentParser(
        prog=PROG,
        description="Plot a run's metrics (ftsdp.train --metrics), fault logs and the fault "
        "suite's report as one page, or the benchmarks' JSON results as bar charts.",
    )
    p.add_argument("files", nargs="*", metavar="FILE.jsonl", help="metrics, fault logs, reports")
    p.add_argument("-o", "--output", default="report.html", help="report.html or report.png")
    p.add_argument("--bench", metavar="FILE.json", help="chart the benchmarks' JSON results")
    p.add_argument("--title", help="the page's title")
    p.add_argument("--dpi", type=int, default=80, help="resolution of the figure")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    args = p.parse_args(argv)
    if args.bench and args.files:
        p.error("give either --bench FILE.json or metrics files, not both")
    if not args.bench and not args.files:
        p.error("give one or more metrics JSONL files (or --bench FILE.json)")
    if args.dpi < 10:
        p.error(f"--dpi {args.dpi}: use 10 or more")
    return args


def main(
    argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """The ``ftsdp-report`` command; returns its exit code (argparse's usage errors exit 2)."""
    out, err = out or sys.stdout, err or sys.stderr
    args = parse(sys.argv[1:] if argv is None else list(argv))
    try:
        output_kind(args.output)
        if args.bench:
            report = build_bench(args.bench, title=args.title, dpi=args.dpi)
        else:
            report = build_report(args.files, title=args.title, dpi=args.dpi, warn_skipped=False)
        if report.skipped:
            err.write(report.skipped_summary() + "\n")
        report.save(args.output)
    except (MissingExtraError, ValueError) as e:  # the other errors here are ValueErrors
        err.write(f"{PROG}: error: {e}\n")
        return EXIT_USAGE
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        err.write(f"{PROG}: error:{where}: {e.strerror or e}\n")
        return EXIT_USAGE
    parts = []
    if report.runs:
        parts.append(f"{len(report.runs)} run{'s' if len(report.runs) > 1 else ''}")
        parts.append(f"{len(report.faults)} fault{'s' if len(report.faults) != 1 else ''}")
    if report.suite:
        parts.append(f"{len(report.suite)} fault-suite scenarios")
    what = "benchmark charts" if args.bench else ", ".join(parts)
    out.write(f"wrote {args.output} ({os.path.getsize(args.output) / 1e3:.0f} kB; {what})\n")
    return EXIT_OK
