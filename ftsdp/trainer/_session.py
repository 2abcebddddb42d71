"""The elastic runtime around one worker: rank manager, logs, step hook, signals, watchdog,
ledger. Built in order on a ``contextlib.ExitStack``; closed in reverse.

[Note: closing the session]
``Session.open`` opens the parts one by one and registers each one's ``close`` as soon as it is
open; if opening fails midway, what is already open is closed in reverse and the opening error
propagates. ``Session.close`` runs every closer in reverse order even when one raises, then
raises the *first* error (a plain ``ExitStack.close()`` would raise the last, with the others
chained), and logs the later ones. It is idempotent. Used as a context manager, a session that
ends with an error records it (an ``error`` event, from any rank) and, if closing fails too,
logs that and lets the original error propagate.

The job's ``CheckpointManager`` is not closed here: the loop closes it when training ends, and
after an error the in-flight async save is abandoned (its thread is a daemon). Waiting for it
could block on the done marker of a peer that died; the step is then simply not committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any

from ftsdp.elastic import PreemptionHandler, RankManager, Watchdog
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._hooks import HookFactory, NoStepHook, StepHook

logger = logging.getLogger(__name__)


class MetricsLog:
    """Rank 0's log: one line per interval on stdout, and optionally one JSON record each.

    ``event`` records (errors, faults seen, resumes) may come from any rank: each is one
    ``write`` of one line to a file opened for appending, so ranks do not interleave.
    """

    def __init__(self, path: str | None, enabled: bool, rank: int = 0):
        self.enabled = enabled
        self.rank = rank
        self._file: IO[str] | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, line: str, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        print(line, flush=True)
        self._append(record)

    def event(self, record: dict[str, Any], line: str | None = None) -> None:
        """A record from any rank (stamped with rank and wall time); ``line`` goes to stderr."""
        if line:
            print(line, file=sys.stderr, flush=True)
        self._append({**record, "rank": self.rank, "time": time.time()})

    def _append(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Closers:
    """Closers on an ``ExitStack``: :meth:`close` runs them all in reverse, then raises the
    first error (see [Note: closing the session])."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._errors: list[BaseException] = []

    def push(self, close: Callable[[], object]) -> None:
        self._stack.callback(self._run, close)

    def _run(self, close: Callable[[], object]) -> None:
        try:
            close()
        except BaseException as e:  # every closer runs; the first error is raised at the end
            self._errors.append(e)

    def close(self) -> None:
        self._stack.close()
        errors, self._errors = self._errors, []
        for later in errors[1:]:
            logger.warning("another error while closing: %s: %s", type(later).__name__, later)
        if errors:
            raise errors[0]


def _open_ledger(path: str) -> IO[str]:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "a", encoding="utf-8")  # closed by the session


@dataclass(frozen=True, kw_only=True)
class Session:
    """One worker's runtime, open from :meth:`open` to :meth:`close`.

    Every field is set once, when the session is built. ``watchdog`` is None for a world of one
    or with ``--heartbeat-timeout-s 0``; ``ledger`` is None without ``--ledger`` or off rank 0.
    """

    cfg: TrainConfig
    rm: RankManager
    log: MetricsLog
    hook: StepHook
    preempt: PreemptionHandler
    watchdog: Watchdog | None
    ledger: IO[str] | None
    _closers: Closers = field(repr=False)

    @classmethod
    def open(cls, cfg: TrainConfig, hook: HookFactory | None = None) -> Session:
        """Open the parts in order; ``hook`` makes the step hook (default: :class:`NoStepHook`)."""
        closers = Closers()
        try:
            rm = RankManager.init(
                device=cfg.device,
                timeout_s=cfg.pg_timeout_s,
                threads=1 if cfg.deterministic else None,
            )
            closers.push(rm.close)
            rank = rm.rank
            log = MetricsLog(cfg.metrics, enabled=rank == 0, rank=rank)
            closers.push(log.close)
            step_hook: StepHook = (
                NoStepHook()
                if hook is None
                else hook(
                    rank=rank, restart_count=rm.info.restart_count, incarnation=rm.incarnation
                )
            )
            preempt = PreemptionHandler(grace_s=cfg.preempt_grace_s).install()
            closers.push(preempt.close)
            watchdog = None
            if rm.world_size > 1 and cfg.heartbeat_timeout_s > 0:
                watchdog = Watchdog(
                    rm.store("watchdog", timeout_s=cfg.heartbeat_timeout_s),
                    rank,
                    rm.world_size,
                    interval_s=min(1.0, cfg.heartbeat_timeout_s / 4),
                    heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                    progress_timeout_s=cfg.progress_timeout_s or None,
                    peers=[(p.host, p.pid) for p in rm.peers],
                    log=lambda line: log.event({"event": "stall", "message": line}, line),
                ).start()
                closers.push(watchdog.close)
            ledger = _open_ledger(cfg.ledger) if cfg.ledger and rank == 0 else None
            if ledger is not None:
                closers.push(ledger.close)
        except BaseException as opening:
            try:
                closers.close()
            except BaseException as closing:
                logger.warning(
                    "closing a half-opened session after %s also failed: %s: %s",
                    type(opening).__name__,
                    type(closing).__name__,
                    closing,
                )
            raise
        return cls(
            cfg=cfg,
            rm=rm,
            log=log,
            hook=step_hook,
            preempt=preempt,
            watchdog=watchdog,
            ledger=ledger,
            _closers=closers,
        )

    def close(self) -> None:
        """Close every part in reverse order and raise the first error (idempotent)."""
        self._closers.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        self.log.event(
            {"event": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]},
            f"ftsdp.train rank {self.rm.rank}: {type(exc).__name__}: {exc}",
        )
        try:
            self.close()
        except BaseException as closing:
            logger.warning(
                "closing the session after %s also failed: %s: %s",
                type(exc).__name__,
                type(closing).__name__,
                closing,
            )
