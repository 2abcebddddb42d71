"""A progress line on stderr (bytes, rate, ETA) when it is a terminal; nothing otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    """Callable ``(done, total)`` that redraws one line at most ``hz`` times a second."""

    def __init__(self, label: str, stream: TextIO, hz: float = 10.0) -> None:
        self.label, self.stream, self.period = label, stream, 1.0 / hz
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < self.period and done < total:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-6)
        rate = done / elapsed
        frac = done / total if total else 1.0
        eta = (total - done) / rate if rate > 0 else 0.0
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (
            f"\r{self.label} [{bar}] {frac:4.0%} {human_bytes(done)}/{human_bytes(total)} "
            f"{human_bytes(rate)}/s ETA {_clock(eta)}"
        )
        self.stream.write(line + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line (only if something was drawn)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def progress_for(label: str, enabled: bool, stream: TextIO | None = None) -> ProgressBar | None:
    """A bar on ``stream`` (stderr) if enabled and it is a terminal, else None (silent in pipes)."""
    stream = stream or sys.stderr
    if not enabled or not stream.isatty():
        return None
    return ProgressBar(label, stream)
