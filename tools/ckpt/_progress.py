"""Terminal output: text made safe to print, sizes for people, and a progress line on stderr
(bytes, rate, ETA) when it is a terminal (nothing otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def printable(text: object) -> str:
    """``str(text)`` with each non-printable character escaped as Python writes it (``\\x1b``,
    ``\\u202e``): names from a checkpoint must not hide or forge a line (not for JSON output)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class ProgressBar:
    """Callable ``(done, total)`` that redraws one line at most 10 times a second."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label, self.stream = label, stream
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-6)
        rate = done / elapsed
        frac = done / total if total else 1.0
        eta = int((total - done) / rate) if rate > 0 else 0
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        line = (
            f"\r{self.label} [{bar}] {frac:4.0%} {human_bytes(done)}/{human_bytes(total)} "
            f"{human_bytes(rate)}/s ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
        )
        self.stream.write(line + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line (only if something was drawn)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def progress_for(label: str, enabled: bool) -> ProgressBar | None:
    """A bar on stderr if enabled and stderr is a terminal, else None (silent in pipes)."""
    return ProgressBar(label, sys.stderr) if enabled and sys.stderr.isatty() else None
