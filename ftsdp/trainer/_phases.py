"""The ``phases`` record: process start to first step (docs/elastic.md, "Recovery time")."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

# (phase, the mark that ends it), in order; a phase starts at the previous mark present.
PHASES = (
    ("interpreter", "entry"),
    ("import_torch", "torch_imported"),
    ("import_ftsdp", "ftsdp_imported"),
    ("connect", "store_connected"),
    ("rendezvous", "joined"),
    ("process_group", "process_group"),
    ("session", "session_open"),
    ("build", "built"),
    ("load", "resumed"),
    ("first_step", "first_step"),
)
MARKS = ("process_start", *(mark for _, mark in PHASES))


def process_start_time() -> float | None:
    """This process's start (wall time) from ``/proc/self/stat`` and the boot time, to one clock
    tick; None where that is not available."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name may hold spaces
        ticks = int(fields[19])  # field 22, starttime; the fields after ")" begin at field 3
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class Phases:
    """Wall-clock marks of one worker's start (see :data:`PHASES`)."""

    marks: dict[str, float] = field(default_factory=dict)

    def mark(self, name: str, when: float | None = None) -> None:
        """Record mark ``name`` (one of :data:`MARKS`) at ``when`` (default: now)."""
        if name not in MARKS:
            raise ValueError(f"unknown phase mark {name!r}: one of {MARKS}")
        self.marks[name] = time.time() if when is None else when

    def seconds(self) -> dict[str, float]:
        """Each phase whose end mark is present: seconds since the previous mark present."""
        out: dict[str, float] = {}
        last = self.marks.get("process_start")
        for phase, mark in PHASES:
            if mark not in self.marks:
                continue
            if last is not None:
                out[phase] = self.marks[mark] - last
            last = self.marks[mark]
        return out

    def total(self) -> float | None:
        """From the first mark to the last, in seconds; None with fewer than two marks."""
        present = [self.marks[m] for m in MARKS if m in self.marks]
        return present[-1] - present[0] if len(present) > 1 else None

    def record(self, **extra: Any) -> dict[str, Any]:
        """The ``phases`` metrics record: marks in order, phase durations, ``extra`` fields."""
        total = self.total()
        return {
            "event": "phases",
            "marks": {m: self.marks[m] for m in MARKS if m in self.marks},
            "seconds": {k: round(v, 4) for k, v in self.seconds().items()},
            "total_s": None if total is None else round(total, 4),
            **extra,
            "time": time.time(),
        }

    def line(self) -> str:
        """One progress line: the total and every phase that took at least 5 ms."""
        shown = " | ".join(f"{k} {v:.2f}s" for k, v in self.seconds().items() if v >= 0.005)
        total = self.total()
        head = "first step" + ("" if total is None else f" {total:.2f}s after process start")
        return head + (f" | {shown}" if shown else "")
