"""Reading the report's inputs and what they say: the series, the restart markers, the fault
table (docs/report.md, "The fault table"). No matplotlib here."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeGuard

# Records of ``ftsdp.train --metrics`` this report reads, with the fields each must have.
RUN_EVENTS: dict[str, tuple[str, ...]] = {
    "start": ("time", "world_size"),
    "resume": ("time", "step", "world_size", "saved_world_size"),
    "step": ("time", "step", "loss"),
    "checkpoint": ("time", "step", "blocking_s"),
    "preempted": ("time", "step"),
    "done": ("time",),
    "error": ("time",),
    "stall": ("time",),
}
# Known records that carry nothing to plot (read and left alone, not counted as skipped).
QUIET_EVENTS = ("checkpoint_warning", "init_from", "phases")
FAULT_FIELDS = ("time", "kind", "step")  # a fault log record (FTSDP_FAULT_LOG)
SUITE_FIELDS = ("scenario", "detection_s", "fault_to_first_new_step_s", "steps_lost")
DETECTION = ("error", "stall", "preempted")
COUNTS = ("step", "world_size", "saved_world_size")  # whole numbers wherever they appear
MAX_COUNT = 2**53  # a count beyond this is no run's (nor exact in a float)
MAX_VALUE = 1e100  # a finite number beyond this is no measurement (it breaks the axes' ticks)
MAX_LINE = 1 << 20  # bytes: a longer line is skipped unread (no record comes near it)
MAX_SKIP = 256 << 20  # an overlong line running past this ends the file (/dev/zero has no end)
TRUNCATED = "not JSON (truncated: the writer stopped mid-line)"
PROGRESS = ("start", "resume", "step", "checkpoint")


@dataclass(frozen=True)
class Skipped:
    """One input line the report could not use, and why."""

    path: str
    line: int
    reason: str


@dataclass
class Source:
    """One input file: its usable records by kind (each record keeps its ``_line``)."""

    path: str
    label: str
    events: list[dict[str, Any]] = field(default_factory=list)  # ftsdp.train --metrics
    faults: list[dict[str, Any]] = field(default_factory=list)  # FTSDP_FAULT_LOG
    suite: list[dict[str, Any]] = field(default_factory=list)  # FTSDP_FAULT_REPORT rows


@dataclass(frozen=True)
class Marker:
    """A vertical marker on the loss panel: ``kind`` is restart, resize or preempted."""

    run: str
    kind: str
    step: int
    time: float
    label: str


@dataclass(frozen=True)
class FaultRow:
    """One interruption of a run. ``origin``: ``fault log`` or ``last record``; ``back_time``:
    wall time of the first new step (None: never came back)."""

    run: str
    kind: str
    step: int | None
    detected_by: str | None
    detection_s: float | None
    first_new_step_s: float | None
    steps_lost: int | None
    resumed_from: int | None
    world: str
    origin: str
    fault_time: float
    back_time: float | None


@dataclass
class Incarnation:
    """A run's records from one ``start`` (None: those before the first) to the next."""

    start: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def t0(self) -> float:
        """Wall time of its ``start`` (of its first record without one)."""
        first = self.start if self.start is not None else self.records[0]
        return float(first["time"])

    def first(self, *events: str) -> dict[str, Any] | None:
        """Its first record of one of ``events``, or None."""
        return next((r for r in self.records if r["event"] in events), None)

    def last_step(self) -> int | None:
        """The furthest step its records show completed, or None."""
        done = ("step", "checkpoint", "resume", "preempted")
        return max((r["step"] for r in self.records if r["event"] in done), default=None)


@dataclass
class Run:
    """The sources of one run, its incarnations and the fault-log records in its span."""

    label: str
    sources: list[Source]
    incarnations: list[Incarnation] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # fault-log records in its span
    t0: float = 0.0  # its first record's wall time: the time panels count from here

    def span(self) -> tuple[float, float]:
        """Wall times of its first and last metrics records."""
        times = [r["time"] for s in self.sources for r in s.events]
        return min(times), max(times)


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    """A number that is not NaN or infinite (an int too large for a float is not)."""
    try:
        return _number(value) and math.isfinite(value)
    except OverflowError:
        return False


def _check(record: dict[str, Any], fields: Iterable[str]) -> str | None:
    """The first problem with ``record``'s fields, or None."""
    for name in fields:
        if name not in record:
            return f"without {name!r}"
        value = record[name]
        finite = _finite(value)
        if name in ("time", "step", "world_size", "saved_world_size", "blocking_s") and not finite:
            return f"{name}={value!r} is not a finite number"
        if name == "loss" and not _number(value):
            return f"loss={value!r} is not a number"
    return _absurd(record)


def _absurd(record: dict[str, Any]) -> str | None:
    """Why a number of ``record`` is none a run writes (a count that is not a whole number from
    0 to 2**53, a finite value beyond 1e100: either would break the figure), or None."""
    for name, value in record.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_VALUE:
            return f"{name}={value!r} is out of range (beyond 1e100)"  # no float holds it
        if not _finite(value):
            continue  # NaN and infinities are plotted as gaps; non-numbers are checked above
        if name in COUNTS and not (value == int(value) and 0 <= value <= MAX_COUNT):
            return f"{name}={value!r} is not a whole number from 0 to 2**53"
        if abs(value) > MAX_VALUE:
            return f"{name}={value!r} is out of range (beyond 1e100)"
    return None


def read_source(path: str, label: str | None = None) -> tuple[Source, list[Skipped]]:
    """Read one JSONL file line by line (a line longer than ``MAX_LINE`` is skipped unread): its
    records by kind, and the lines it skipped; OSError if unreadable."""
    source = Source(path=path, label=label or os.path.basename(path))
    skipped: list[Skipped] = []
    with open(path, "rb") as f:
        for number, (line, reason) in enumerate(_lines(f), start=1):
            text = line.decode("utf-8", errors="replace")
            if not reason and text.strip():
                reason = _read_line(source, text, number, last=not line.endswith(b"\n"))
            if reason:
                skipped.append(Skipped(path, number, reason))
    return source, skipped


def _lines(f: BinaryIO) -> Iterator[tuple[bytes, str | None]]:
    """Each line of ``f`` and None, or b"" and why it is not read: longer than ``MAX_LINE``
    (read on to its end, never held whole; past ``MAX_SKIP`` the file's reading stops there)."""
    while line := f.readline(MAX_LINE + 1):
        if len(line) <= MAX_LINE or line.endswith(b"\n"):
            yield line, None
            continue
        read = len(line)
        while line and not line.endswith(b"\n"):
            if read >= MAX_SKIP:
                yield b"", f"longer than {MAX_SKIP >> 20} MiB: the rest of the file is not read"
                return
            line = f.readline(MAX_LINE)
            read += len(line)
        yield b"", f"longer than {MAX_LINE >> 20} MiB"


def _read_line(source: Source, text: str, number: int, last: bool) -> str | None:
    """Add the record of line ``number`` to ``source``; why it cannot be, or None. A line that
    is not JSON but ends in a whole record is a write cut short by a kill, then the next
    incarnation's first record appended to it: that record is read, the cut one skipped."""
    try:
        return _add(source, json.loads(text), number)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; too many digits; too deep
        deep = isinstance(e, RecursionError)
    if last:
        return TRUNCATED
    for at in _record_starts(text):
        try:
            record = json.loads(text[at:])
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict):
            return _add(source, record, number) or TRUNCATED
    return "not JSON (nested too deeply)" if deep else "not JSON"


def _record_starts(text: str) -> Iterator[int]:
    """Where a record may begin inside ``text`` (after its first character), at most 8."""
    at = 0
    for _ in range(8):
        at = text.find('{"event"', at + 1)
        if at < 0:
            return
        yield at


def _add(source: Source, record: Any, number: int) -> str | None:
    """Add line ``number``'s record to ``source`` under its kind; why it cannot be, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    event = record.get("event")
    kept = {**record, "_line": number}
    if event in RUN_EVENTS or event == "fault":
        if problem := _check(record, RUN_EVENTS.get(event, FAULT_FIELDS)):
            return f"{event} record {problem}"
        (source.faults if event == "fault" else source.events).append(kept)
    elif event is None and all(k in record for k in SUITE_FIELDS):
        if problem := _absurd(record):
            return f"fault-suite report row {problem}"
        source.suite.append(kept)
    elif event is None:
        return "no 'event' field, and not a fault-suite report row"
    elif event not in QUIET_EVENTS:
        return f"unknown event {event!r}"
    return None


def summarise(skipped: list[Skipped]) -> str:
    """One line per file: how many lines were skipped, grouped by reason, with line numbers."""
    by_path: dict[str, dict[str, list[int]]] = {}
    for s in skipped:
        by_path.setdefault(s.path, {}).setdefault(s.reason, []).append(s.line)
    out = []
    for path, reasons in by_path.items():
        parts = []
        for reason, numbers in reasons.items():
            shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
            parts.append(f"{len(numbers)} {reason} (line{'s' if len(numbers) > 1 else ''} {shown})")
        n = sum(map(len, reasons.values()))
        out.append(f"skipped {n} line{'s' if n > 1 else ''} of {path}: " + "; ".join(parts))
    return "\n".join(out)


def group_runs(sources: list[Source]) -> list[Run]:
    """Sources with metrics records grouped into runs (files naming one ``--checkpoint-url``),
    split into incarnations, each with the fault-log records in its span."""
    groups: dict[str, list[Source]] = {}
    for s in sources:  # by the --checkpoint-url of the file's first start record, else the file
        start = next((r for r in s.events if r["event"] == "start"), None)
        url = (start.get("config") or {}).get("checkpoint_url") if start else None
        if s.events:
            groups.setdefault(f"url:{url}" if url else f"file:{s.path}", []).append(s)
    runs = []
    for members in groups.values():
        label = members[0].label if len(members) == 1 else " + ".join(m.label for m in members)
        run = Run(label=label, sources=members)
        for part in _split([r for s in members for r in s.events]):
            start = part[0] if part[0]["event"] == "start" else None
            run.incarnations.append(Incarnation(start, part[1:] if start else part))
        runs.append(run)
    faults = sorted((f for s in sources for f in s.faults), key=lambda f: f["time"])
    for f in faults:
        # the run whose span holds it; else the last run that started before it
        holders = [r for r in runs if r.span()[0] <= f["time"] <= r.span()[1]]
        holders += [r for r in reversed(runs) if r.span()[0] <= f["time"]]
        if holders:
            holders[0].faults.append(f)
    for run in runs:
        run.t0 = min([run.span()[0], *(f["time"] for f in run.faults)])
    labels = Counter(r.label for r in runs)
    for i, run in enumerate(runs):  # two runs from files of the same name
        if labels[run.label] > 1:
            run.label = f"{run.label} ({i + 1})"
    return runs


def markers(run: Run) -> list[Marker]:
    """The run's restart, resize and preemption markers, in time order."""
    out = []
    for inc in run.incarnations:
        for r in inc.records:
            if r["event"] == "resume":
                a, b = int(r["saved_world_size"]), int(r["world_size"])
                kind = "restart" if a == b else "resize"
                n = r.get("restarts")
                what = f"restart {n}" if kind == "restart" and n is not None else kind
                world = f"world {a}" if a == b else f"world {a}→{b}"
                label = f"{what}: from step {r['step']} ({world})"
                out.append(Marker(run.label, kind, int(r["step"]), r["time"], label))
            elif r["event"] == "preempted":
                label = f"preempted at step {r['step']}"
                out.append(Marker(run.label, "preempted", int(r["step"]), r["time"], label))
    return out


def fault_rows(run: Run) -> list[FaultRow]:
    """The run's interruptions, measured as docs/report.md says."""
    rows = []
    incs = run.incarnations
    for inc, nxt, later in itertools.zip_longest(incs, incs[1:], incs[2:]):
        detected = inc.first(*DETECTION)
        done = inc.first("done")
        if detected is None and (done is not None or nxt is None):
            continue  # a clean end, or the last incarnation still going (or silent)
        end = nxt.t0 if nxt is not None else math.inf
        fault = next((f for f in run.faults if inc.t0 <= f["time"] < end), None)
        last_step = inc.last_step()
        if fault is not None:
            t_fault, origin = float(fault["time"]), "fault log"
            kind = str(fault["kind"]) + (f":{fault['point']}" if fault.get("point") else "")
            step: int | None = int(fault["step"])
        else:
            limit = detected["time"] if detected is not None else end
            progress = [r for r in inc.records if r["event"] in PROGRESS and r["time"] <= limit]
            t_fault = progress[-1]["time"] if progress else inc.t0
            origin = "last record"
            kind = detected["event"] if detected is not None else "ended without a record"
            step = last_step
        resume = nxt.first("resume") if nxt else None
        first_new = (
            _first_new_step(run, nxt, resume, later.t0 if later else math.inf) if nxt else None
        )
        # a resume from a step proves it was completed, whatever records the kill cut
        completed = max(last_step or 0, step or 0, 0 if resume is None else int(resume["step"]))
        if resume is not None:
            world = f"{resume['saved_world_size']} → {resume['world_size']}"
        else:
            size = inc.start["world_size"] if inc.start is not None else "?"
            world = f"{size} → " + ("(started over)" if nxt is not None else "(ended)")
        rows.append(
            FaultRow(
                run=run.label,
                kind=kind,
                step=step,
                detected_by=None if detected is None else detected["event"],
                detection_s=None if detected is None else detected["time"] - t_fault,
                first_new_step_s=None if first_new is None else first_new["time"] - t_fault,
                steps_lost=None if resume is None else completed - int(resume["step"]),
                resumed_from=None if resume is None else int(resume["step"]),
                world=world,
                origin=origin,
                fault_time=t_fault,
                back_time=None if first_new is None else float(first_new["time"]),
            )
        )
    return rows


def _first_new_step(
    run: Run, nxt: Incarnation, resume: dict[str, Any] | None, end: float
) -> dict[str, Any] | None:
    """The earliest record showing ``nxt`` completed a step past the one it resumed from."""
    after = resume["time"] if resume is not None else nxt.t0
    base = int(resume["step"]) if resume is not None else 0
    seen = [
        r
        for r in nxt.records
        if r["event"] in ("step", "checkpoint") and r["time"] >= after and r["step"] > base
    ]
    seen += [f for f in run.faults if nxt.t0 <= f["time"] < end and f["step"] > base]
    return min(seen, key=lambda r: r["time"], default=None)


def _split(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``records`` in wall-time order, split at each ``start``."""
    out: list[list[dict[str, Any]]] = [[]]
    for r in sorted(records, key=lambda r: r["time"]):
        if r["event"] == "start" and out[-1]:
            out.append([])
        out[-1].append(r)
    return out


def joined(parts: list[list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    """Points of several pieces as one line's data, a NaN between pieces (a gap, not a jump)."""
    points: list[tuple[float, float]] = []
    for part in filter(None, parts):
        if points:
            points.append((math.nan, math.nan))
        points += part
    return [x for x, _ in points], [y for _, y in points]


def series(
    source: Source, t0: float, key: str, by: str = "time"
) -> tuple[list[float], list[float]]:
    """``key`` of the file's ``step`` records against ``by`` (``time``: seconds from ``t0``, or
    ``step``), one piece per incarnation."""
    parts = []
    for inc in _split(source.events):
        steps = [r for r in inc if r["event"] == "step" and _number(r.get(key))]
        xs = [r["time"] - t0 if by == "time" else r["step"] for r in steps]
        parts.append([(float(x), float(r[key])) for x, r in zip(xs, steps, strict=True)])
    return joined(parts)


def world_series(source: Source, t0: float) -> tuple[list[float], list[float]]:
    """World size against seconds from ``t0``: from each incarnation's start to its last
    record, one piece per incarnation."""
    parts = []
    for inc in _split(source.events):
        part = []
        for r in inc:
            size = r.get("world_size")
            if r["event"] in ("start", "resume", "step") and _number(size):
                part.append((r["time"] - t0, float(size)))
        if part and inc[-1]["time"] - t0 > part[-1][0]:
            part.append((inc[-1]["time"] - t0, part[-1][1]))
        parts.append(part)
    return joined(parts)


def saves(source: Source) -> list[tuple[int, float]]:
    """``(step, blocking seconds)`` of each ``checkpoint`` record, in time order."""
    return [
        (int(r["step"]), float(r["blocking_s"]))
        for r in sorted(source.events, key=lambda r: r["time"])
        if r["event"] == "checkpoint"
    ]
