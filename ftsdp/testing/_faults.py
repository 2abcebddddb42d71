"""Deterministic fault injection for the fault suite, driven by the ``FTSDP_FAULT`` variable.

``FTSDP_FAULT`` holds faults separated by ``;``, each ``kind:key=value:...``::

    kill:rank=1:step=7                        SIGKILL this worker after step 7
    stop:rank=1:step=7                        SIGSTOP this worker (a hung rank)
    term:rank=0:step=5:target=agent           SIGTERM the torchrun agent (or target=self)
    usr1:rank=0:step=5                        SIGUSR1 this worker
    exit:rank=1:step=4:code=3                 os._exit(code)
    hang:rank=1:step=4                        block the main thread forever (heartbeats go on)
    kill_node:step=7                          SIGKILL the agent, its workers and this process
    crash_in_save:point=before_manifest:step=10
                                              die inside the checkpoint write of step 10:
                                              point=after_data (n=K: after K data objects of
                                              this rank), before_manifest, before_latest

Common keys: ``rank`` (default: any rank), ``restart`` (fire only when
``TORCHELASTIC_RESTART_COUNT`` equals it; default 0, so a restarted worker does not fail again;
``restart=any`` always fires), ``when=before_save|after_save`` (relative to the checkpoint the
loop may start at that step boundary; ``term`` and ``usr1`` default to ``after_save`` so an
async save is in flight when the signal lands, the others to ``before_save``).

Before firing, a fault appends ``{"event": "fault", ...}`` with the wall time to the JSONL file
named by ``FTSDP_FAULT_LOG`` (and to stderr), which is how the suite measures detection and
recovery times. Faults fire at step boundaries (after step ``step`` completed), never on a timer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

KINDS = ("kill", "stop", "term", "usr1", "exit", "hang", "kill_node", "crash_in_save")
SAVE_POINTS = ("after_data", "before_manifest", "before_latest")
EXIT_INJECTED = 91  # the exit status of crash_in_save and of exit without code=


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    restart: int | None = 0
    when: str = "before_save"
    point: str | None = None
    n: int = 1
    code: int = EXIT_INJECTED
    target: str = "self"

    def describe(self) -> str:
        extra = f" point={self.point}" if self.point else ""
        return f"{self.kind}{extra} at step {self.step}"


def parse_faults(spec: str) -> list[Fault]:
    """``FTSDP_FAULT`` -> faults; a malformed spec raises ``ValueError`` naming the part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, *pairs = part.split(":")
        if kind not in KINDS:
            raise ValueError(
                f"FTSDP_FAULT: unknown fault kind {kind!r} in {part!r}; one of {KINDS}"
            )
        kw: dict[str, object] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"FTSDP_FAULT: {pair!r} in {part!r} must be key=value")
            if key in ("step", "rank", "n", "code"):
                kw[key] = int(value)
            elif key == "restart":
                kw[key] = None if value == "any" else int(value)
            elif key in ("point", "target", "when"):
                kw[key] = value
            else:
                raise ValueError(f"FTSDP_FAULT: unknown key {key!r} in {part!r}")
        if "step" not in kw:
            raise ValueError(f"FTSDP_FAULT: {part!r} needs step=N")
        if kind in ("term", "usr1"):
            kw.setdefault("when", "after_save")
        if kind == "crash_in_save" and kw.get("point") not in SAVE_POINTS:
            raise ValueError(f"FTSDP_FAULT: {part!r} needs point= one of {SAVE_POINTS}")
        if kw.get("when", "before_save") not in ("before_save", "after_save"):
            raise ValueError(f"FTSDP_FAULT: when= in {part!r} must be before_save or after_save")
        if kw.get("target", "self") not in ("self", "agent"):
            raise ValueError(f"FTSDP_FAULT: target= in {part!r} must be self or agent")
        faults.append(Fault(kind, **kw))  # type: ignore[arg-type]
    return faults


_incarnation = ""  # set by FaultInjector.bind: which start of the worker group fired a fault


def log_fault(fault: Fault, rank: int, **extra: object) -> None:
    """Record the fault (wall time) in ``FTSDP_FAULT_LOG`` and on stderr before it fires."""
    record = {
        "event": "fault",
        "kind": fault.kind,
        "point": fault.point,
        "rank": rank,
        "step": fault.step,
        "pid": os.getpid(),
        "incarnation": _incarnation,
        "time": time.time(),
        **extra,
    }
    print(f"ftsdp: injecting fault {fault.describe()} on rank {rank}", file=sys.stderr, flush=True)
    path = os.environ.get("FTSDP_FAULT_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    with (
        contextlib.suppress(OSError),
        open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f,
    ):
        return [int(c) for c in f.read().split()]
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with (
            contextlib.suppress(OSError, IndexError, ValueError),
            open(f"/proc/{entry}/stat", encoding="ascii") as f,
        ):
            if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:  # field 4: ppid
                out.append(int(entry))
    return out


class FaultInjector:
    """The faults of ``FTSDP_FAULT`` that apply to this rank and restart count."""

    def __init__(self, faults: list[Fault], rank: int, restart_count: int) -> None:
        self.rank = rank
        self.faults = [
            f
            for f in faults
            if (f.rank is None or f.rank == rank)
            and (f.restart is None or f.restart == restart_count)
        ]

    @classmethod
    def from_env(
        cls, rank: int, restart_count: int, env: Mapping[str, str] | None = None
    ) -> FaultInjector:
        env = os.environ if env is None else env
        return cls(parse_faults(env.get("FTSDP_FAULT", "")), rank, restart_count)

    def bind(self, incarnation: str) -> FaultInjector:
        """Name the incarnation in the fault records (so a report can tell restarts apart)."""
        global _incarnation
        _incarnation = incarnation
        return self

    def checkpoint_url(self, url: str) -> str:
        """``url`` rewritten to the faulty filesystem when a crash_in_save fault applies here."""
        saves = [f for f in self.faults if f.kind == "crash_in_save"]
        if not saves:
            return url
        from ftsdp.testing import _faulty_fs

        return _faulty_fs.arm(url, saves, self.rank)

    def at_step_end(self, step: int) -> None:
        """Fire the ``before_save`` faults of ``step``."""
        self._fire(step, "before_save")

    def after_save(self, step: int) -> None:
        """Fire the ``after_save`` faults of ``step``."""
        self._fire(step, "after_save")

    def _fire(self, step: int, when: str) -> None:
        for f in self.faults:
            if f.step != step or f.when != when or f.kind == "crash_in_save":
                continue
            log_fault(f, self.rank)
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif f.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif f.kind in ("term", "usr1"):
                sig = signal.SIGTERM if f.kind == "term" else signal.SIGUSR1
                os.kill(os.getppid() if f.target == "agent" else os.getpid(), sig)
            elif f.kind == "exit":
                os._exit(f.code)
            elif f.kind == "hang":
                while True:
                    time.sleep(3600)
            elif f.kind == "kill_node":
                agent = os.getppid()
                siblings = _children(agent)
                os.kill(agent, signal.SIGKILL)
                for pid in siblings:
                    if pid != os.getpid():
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
