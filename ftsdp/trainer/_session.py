"""One worker's runtime, opened in order and closed in reverse (docs/elastic.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Protocol, runtime_checkable

from ftsdp import storage
from ftsdp.elastic import PreemptionHandler, RankManager, Watchdog, read_env
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._errors import JobError
from ftsdp.trainer._phases import Phases

logger = logging.getLogger(__name__)
progress = logging.getLogger("ftsdp.train")  # the entry's lines: progress, events, errors

FORMAT = "%(asctime)s rank %(rank)s %(levelname)s %(name)s: %(message)s"
# --tensorboard: which fields of which records become which scalars
TAGS: dict[str, dict[str, str]] = {
    "step": {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s",
        "s_per_step": "perf/s_per_step",
        "world_size": "elastic/world_size",
        "restarts": "elastic/restarts",
    },
    "checkpoint": {"blocking_s": "checkpoint/blocking_s"},
    "resume": {"seconds": "elastic/resume_s", "world_size": "elastic/world_size"},
}
INSTALL = "pip install 'ftsdp[tensorboard]' (or pip install tensorboard)"


class TensorBoardScalars:
    """``--tensorboard DIR``: a ``SummaryWriter`` fed rank 0's metrics records, flushed as each is
    written (docs/report.md, "TensorBoard")."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def record(self, record: dict[str, Any]) -> None:
        """Write the record's scalars (:data:`TAGS`); other records are ignored."""
        event, step, when = record.get("event", ""), record.get("step"), record.get("time")
        if not isinstance(step, int):
            return
        wrote = False
        for key, tag in TAGS.get(event, {}).items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), global_step=step, walltime=when)
                wrote = True
        if event == "preempted":
            self.writer.add_scalar("elastic/preempted", 1.0, global_step=step, walltime=when)
            wrote = True
        if wrote:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(logdir: str) -> TensorBoardScalars:
    """A writer into ``logdir``; :class:`JobError` naming the install if tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise JobError(f"--tensorboard {logdir} needs the tensorboard package: {INSTALL}") from None
    try:
        writer = SummaryWriter(log_dir=logdir)
    except OSError as e:
        raise JobError(f"--tensorboard {logdir}: cannot write there: {e.strerror or e}") from None
    logger.info("TensorBoard scalars in %s (tensorboard --logdir %s)", logdir, logdir)
    return TensorBoardScalars(writer)


class ConsoleHandler(logging.StreamHandler):
    """Below WARNING to stdout, the rest to stderr, each looked up per record (pytest's capture
    replaces them) and flushed; records are stamped with ``rank`` for :data:`FORMAT`."""

    def __init__(self, rank: int, level: int = logging.NOTSET):
        super().__init__()
        self.setLevel(level)
        self.rank = rank
        self.setFormatter(logging.Formatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        record.rank = self.rank
        self.stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
        super().emit(record)  # under the handler's lock: the stream is this record's


def console_logging(level: str, rank: int) -> Callable[[], None]:
    """Install one :class:`ConsoleHandler` on the ``ftsdp`` logger (rank 0 from ``level``, the
    others from WARNING unless DEBUG); returns the function that removes it."""
    root = logging.getLogger("ftsdp")
    wanted = logging.getLevelName(level.upper())
    if not isinstance(wanted, int):
        raise ValueError(f"log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    shown = wanted if rank == 0 or wanted <= logging.DEBUG else max(wanted, logging.WARNING)
    handler = ConsoleHandler(rank, shown)
    before = root.level
    for old in [h for h in root.handlers if isinstance(h, ConsoleHandler)]:
        root.removeHandler(old)  # one handler, even after a session that was never closed
    root.addHandler(handler)
    root.setLevel(shown)

    def remove() -> None:
        root.removeHandler(handler)
        root.setLevel(before)

    return remove


class MetricsLog:
    """Rank 0's progress lines (the ``ftsdp.train`` logger, INFO) and their JSON records, any
    rank's :meth:`event` records (one appended line each), and a ``--tensorboard`` sink."""

    def __init__(self, path: str | None, enabled: bool, rank: int = 0):
        self.enabled = enabled
        self.rank = rank
        self._file: IO[str] | None = _open_append(path) if path else None
        self._sink: TensorBoardScalars | None = None

    def write(self, line: str, record: dict[str, Any]) -> None:
        """Rank 0's progress ``line`` (logged at INFO) and its JSON ``record``."""
        if not self.enabled:
            return
        progress.info("%s", line)
        self._append(record)

    def event(
        self, record: dict[str, Any], line: str | None = None, level: int = logging.WARNING
    ) -> None:
        """A record from any rank (rank and time stamped); ``line`` logged at ``level``."""
        if line:
            progress.log(level, "%s", line)
        self._append({**record, "rank": self.rank, "time": time.time()})

    def attach(self, sink: TensorBoardScalars) -> None:
        """Send every later record to ``sink`` as well (one sink; closed by :meth:`close`)."""
        self._sink = sink

    def _append(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._sink is not None:
            self._sink.record(record)

    def close(self) -> None:
        sink, self._sink = self._sink, None
        try:
            if sink is not None:
                sink.close()
        finally:
            if self._file is not None:
                self._file.close()
                self._file = None


class Closers:
    """Closers on an ``ExitStack``: :meth:`close` runs them all in reverse, then raises the
    first error (a plain ``ExitStack.close()`` raises the last) and logs the later ones."""

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


def _open_append(path: str) -> IO[str]:
    """``path`` opened for appending, its folder made; the caller closes it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, "a", encoding="utf-8")


def _close_after(error: BaseException, close: Callable[[], None], what: str) -> None:
    """``close()`` while ``error`` propagates: a failure of its own is logged, not raised."""
    try:
        close()
    except BaseException as closing:
        failed = f"{type(closing).__name__}: {closing}"
        logger.warning("%s after %s also failed: %s", what, type(error).__name__, failed)


@runtime_checkable
class StepHook(Protocol):
    """The step hook, satisfied by shape: ``ftsdp.testing`` needs nothing of the trainer."""

    def checkpoint_url(self, url: str) -> str: ...

    def at_step_end(self, step: int) -> None: ...

    def after_save(self, step: int) -> None: ...

    # Optional: ``needs_commit(step) -> bool``; when true, the loop waits for the save in flight
    # to commit, then calls ``after_commit(step)`` (the fault suite's ``when=after_commit``).


class HookFactory(Protocol):
    """Makes a worker's hook from its rank, restart count, incarnation and ``agent`` pid."""

    def __call__(
        self, *, rank: int, restart_count: int, incarnation: str, agent: int | None
    ) -> StepHook: ...


class NoStepHook:
    """The default hook: the URL unchanged, nothing at step boundaries."""

    def checkpoint_url(self, url: str) -> str:
        return url

    def at_step_end(self, step: int) -> None:
        pass

    def after_save(self, step: int) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Session:
    """One worker's runtime, open from :meth:`open` to :meth:`close`. ``watchdog``: None for a
    world of one outside torchrun or with ``--heartbeat-timeout-s 0``; ``ledger``: None without
    ``--ledger`` or off rank 0; ``phases``: the worker's start marks (``_phases``)."""

    cfg: TrainConfig
    rm: RankManager
    log: MetricsLog
    hook: StepHook
    preempt: PreemptionHandler
    watchdog: Watchdog | None
    ledger: IO[str] | None
    phases: Phases = field(default_factory=Phases)
    _closers: Closers = field(repr=False)

    @classmethod
    def open(
        cls, cfg: TrainConfig, hook: HookFactory | None = None, phases: Phases | None = None
    ) -> Session:
        """Open the parts in order; ``hook`` makes the step hook (default: :class:`NoStepHook`);
        ``phases``: the marks taken before (the entry's), to which the session adds its own."""
        closers = Closers()
        phases = Phases() if phases is None else phases
        try:
            # First opened, last closed: closing errors are still shown. torchrun sets RANK
            # before the process starts (read_env checks it); RankManager.init may log already.
            closers.push(console_logging(cfg.log_level, read_env().rank))
            rm = RankManager.init(
                device=cfg.device,
                timeout_s=cfg.pg_timeout_s,
                threads=1 if cfg.deterministic else None,
            )
            closers.push(rm.close)
            phases.marks.update(rm.marks)
            rank = rm.rank
            log = MetricsLog(cfg.metrics, enabled=rank == 0, rank=rank)
            closers.push(log.close)
            step_hook: StepHook = (
                NoStepHook()
                if hook is None
                else hook(
                    rank=rank,
                    restart_count=rm.info.restart_count,
                    incarnation=rm.incarnation,
                    agent=rm.agent.pid if rm.agent is not None else None,
                )
            )
            preempt = PreemptionHandler(grace_s=cfg.preempt_grace_s).install()
            closers.push(preempt.close)
            if rm.agent is not None:  # an orphan commits nothing (docs/elastic.md)
                closers.push(storage.saving.guard_commits(rm.exit_if_orphaned))
            watchdog = None
            torchrun = rm.world_size > 1 or rm.agent is not None
            store = None  # (one rank started by hand with torchrun's variables has none)
            if torchrun and cfg.heartbeat_timeout_s > 0:
                store = rm.store("watchdog", timeout_s=cfg.heartbeat_timeout_s)
            if store is not None:
                watchdog = Watchdog(
                    store,
                    rank,
                    rm.world_size,
                    interval_s=min(1.0, cfg.heartbeat_timeout_s / 4),
                    heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                    progress_timeout_s=cfg.progress_timeout_s or None,
                    peers=[(p.host, p.pid) for p in rm.peers],
                    agent_check=rm.exit_if_orphaned,
                    log=lambda line: log.event(
                        {"event": "stall", "message": line}, line, logging.ERROR
                    ),
                ).start()
                closers.push(watchdog.close)
            ledger = _open_append(cfg.ledger) if cfg.ledger and rank == 0 else None
            if ledger is not None:
                closers.push(ledger.close)
        except BaseException as opening:
            _close_after(opening, closers.close, "closing a half-opened session")
            raise
        phases.mark("session_open")
        return cls(
            cfg=cfg,
            rm=rm,
            log=log,
            hook=step_hook,
            preempt=preempt,
            watchdog=watchdog,
            ledger=ledger,
            phases=phases,
            _closers=closers,
        )

    def close(self) -> None:
        """Close every part in reverse order and raise the first error (idempotent)."""
        self._closers.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # A peer that left because the agent is gone breaks this rank's collectives: say why.
        self.rm.exit_if_orphaned()
        try:
            self.log.event(
                {"event": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]},
                f"{type(exc).__name__}: {exc}",  # the handler's prefix names the rank
                logging.ERROR,
            )
        except Exception as recording:  # the parts are closed all the same
            logger.warning("could not record %s: %r", type(exc).__name__, recording)
        _close_after(exc, self.close, "closing the session")
