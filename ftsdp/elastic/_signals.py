"""Preemption: SIGTERM / SIGUSR1, agreed at the next step boundary (docs/elastic.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence

EXIT_GRACE_EXCEEDED = 87
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

logger = logging.getLogger(__name__)


class PreemptionHandler:
    """Owns the handlers of ``signals`` from :meth:`install` to :meth:`close`: ``requested`` turns
    True when one arrives; ``grace_s`` after it (or :meth:`arm`) the process exits with
    ``EXIT_GRACE_EXCEEDED`` (``on_expired`` replaces that); ``log``: default logger, WARNING."""

    def __init__(
        self,
        *,
        grace_s: float = 20.0,
        signals: Sequence[signal.Signals] = DEFAULT_SIGNALS,
        log: Callable[[str], None] | None = None,
        on_expired: Callable[[str], None] | None = None,
    ) -> None:
        if grace_s <= 0:
            raise ValueError(f"PreemptionHandler: grace_s={grace_s} must be > 0")
        self.grace_s = grace_s
        self.signals = tuple(signals)
        self.signal_name: str | None = None
        self.received_at: float | None = None  # time.time() of the first signal
        self._log = log or logger.warning
        self._on_expired = on_expired
        self._deadline: float | None = None  # time.monotonic()
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._pipes: list[int] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._no_save: str | None = None  # why a signal can no longer be answered with a save

    @property
    def requested(self) -> bool:
        """True once this process got one of the signals."""
        return self.signal_name is not None

    def install(self) -> PreemptionHandler:
        """Install the handlers (main thread only) and start the watcher thread."""
        if self._thread is not None:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler.install() must run in the main thread")
        wake_r, wake_w = os.pipe()
        stop_r, stop_w = os.pipe()
        self._pipes = [wake_r, wake_w, stop_r, stop_w]
        os.set_blocking(wake_w, False)
        try:
            for sig in self.signals:
                # a no-op handler: the watcher records the signal from the wakeup fd (a lock in
                # a handler could deadlock ``arm``)
                self._previous[sig] = signal.signal(sig, lambda signum, frame: None)
            self._previous_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._watch, name="ftsdp-preemption", daemon=True)
        self._thread.start()
        return self

    def _record(self, signum: int) -> None:
        with self._lock:
            if self.signal_name is None:
                self.signal_name = signal.Signals(signum).name
                self.received_at = time.time()
                self._arm_locked()
                plan = (
                    "saving at the next step boundary"
                    if self._no_save is None
                    else f"nothing will be saved ({self._no_save})"
                )
                self._log(
                    f"ftsdp: {self.signal_name} received (pid {os.getpid()}): {plan}, exiting "
                    f"within {self.grace_s:g}s"
                )

    def cannot_save(self, why: str) -> None:
        """From now on a signal's line says nothing will be saved, and ``why``."""
        with self._lock:
            self._no_save = why

    def arm(self) -> None:
        """Start the grace period now (a rank that learned of a peer's preemption)."""
        with self._lock:
            self._arm_locked()

    def _arm_locked(self) -> None:
        if self._deadline is None:
            self._deadline = time.monotonic() + self.grace_s
            if len(self._pipes) == 4:  # wake the watcher so it waits for the new deadline
                with contextlib.suppress(OSError):
                    os.write(self._pipes[1], b"\0")

    def _watch(self) -> None:
        wake_r, _, stop_r, _ = self._pipes
        while not self._stopping:
            deadline = self._deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([wake_r, stop_r], [], [], timeout)
            except (OSError, ValueError):
                return  # pipes closed by close()
            if stop_r in ready or self._stopping:
                return
            if wake_r in ready:
                try:
                    data = os.read(wake_r, 64)
                except OSError:
                    return
                for signum in data:
                    if signum in self.signals:
                        self._record(signum)
            if self._deadline is not None and time.monotonic() >= self._deadline:
                self._expire()
                return

    def _expire(self) -> None:
        message = (
            f"ftsdp: preemption grace period of {self.grace_s:g}s exceeded "
            f"({self.signal_name or 'peer preemption'}); exiting with {EXIT_GRACE_EXCEEDED}"
        )
        if self._on_expired is not None:
            self._on_expired(message)
            return
        self._log(message)
        os._exit(EXIT_GRACE_EXCEEDED)

    def close(self) -> None:
        """Restore the previous handlers and stop the watcher (idempotent, always works)."""
        self._stopping = True
        if self._previous and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(Exception):
                signal.set_wakeup_fd(self._previous_wakeup)
            for sig, handler in self._previous.items():
                with contextlib.suppress(Exception):
                    signal.signal(sig, handler)  # type: ignore[arg-type]
            self._previous = {}
        if len(self._pipes) == 4:
            with contextlib.suppress(OSError):
                os.write(self._pipes[3], b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for fd in self._pipes:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipes = []

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.close()
