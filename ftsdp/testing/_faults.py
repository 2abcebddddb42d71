"""Fault injection driven by ``FTSDP_FAULT`` (docs/elastic.md); imports nothing else of ftsdp."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass

KINDS = ("kill", "stop", "term", "usr1", "exit", "hang", "kill_node", "crash_in_save")
SAVE_POINTS = ("after_data", "before_manifest", "before_latest")
WHEN = ("before_save", "after_save", "after_commit")
EXIT_INJECTED = 91  # the exit status of crash_in_save and of exit without code=

logger = logging.getLogger(__name__)


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
        if kw.get("when", "before_save") not in WHEN:
            raise ValueError(f"FTSDP_FAULT: when= in {part!r} must be one of {', '.join(WHEN)}")
        if kw.get("target", "self") not in ("self", "agent"):
            raise ValueError(f"FTSDP_FAULT: target= in {part!r} must be self or agent")
        faults.append(Fault(kind, **kw))  # type: ignore[arg-type]
    return faults


def log_fault(fault: Fault, rank: int, incarnation: str = "", **extra: object) -> None:
    """Record the fault in ``FTSDP_FAULT_LOG`` and on the log before it fires."""
    record = {
        "event": "fault",
        "kind": fault.kind,
        "point": fault.point,
        "rank": rank,
        "step": fault.step,
        "pid": os.getpid(),
        "incarnation": incarnation,
        "time": time.time(),
        **extra,
    }
    logger.warning("ftsdp: injecting fault %s on rank %d", fault.describe(), rank)
    if path := os.environ.get("FTSDP_FAULT_LOG"):
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _parent(pid: int) -> int | None:
    """The parent of ``pid`` (Linux /proc; None: unreadable)."""
    with (
        contextlib.suppress(OSError, IndexError, ValueError),
        open(f"/proc/{pid}/stat", encoding="ascii") as f,
    ):
        return int(f.read().rsplit(")", 1)[1].split()[1])  # field 4: ppid
    return None


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _parent(int(e)) == pid]


_AGENTS = ("torchrun", "torch.distributed.run", "torch/distributed/run.py", "ftsdp.launch")


def is_agent(pid: int | None) -> bool:
    """Whether ``pid`` is the torchrun agent or ``ftsdp.launch`` that started this worker
    (parent, or grandparent under a fork server): faults that signal the agent act only then."""
    if pid is None or pid <= 1:
        return False
    ancestors = {os.getppid(), _parent(os.getppid())}
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return pid in ancestors and any(a.endswith(_AGENTS) for a in argv[:3])


def applicable(faults: list[Fault], rank: int, restart_count: int) -> list[Fault]:
    """The faults that apply to ``rank`` in the restart ``restart_count``."""
    return [
        f
        for f in faults
        if (f.rank is None or f.rank == rank) and (f.restart is None or f.restart == restart_count)
    ]


def fire(fault: Fault, rank: int, incarnation: str = "", agent: int | None = None) -> None:
    """Log ``fault``, then do it (a step-boundary fault); one signalling ``agent`` (the launcher's
    pid) is refused unless :func:`is_agent`."""
    if fault.kind == "crash_in_save":
        raise ValueError("crash_in_save fires inside a checkpoint write (faulty://), not here")
    if (fault.kind == "kill_node" or fault.target == "agent") and not is_agent(agent):
        logger.error(
            f"ftsdp: refusing fault {fault.describe()} on rank {rank}: it signals the agent, and "
            f"this process was not started by torchrun or ftsdp.launch (parent pid {os.getppid()})"
        )
        return
    log_fault(fault, rank, incarnation)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind in ("term", "usr1"):
        sig = signal.SIGTERM if fault.kind == "term" else signal.SIGUSR1
        os.kill(agent if agent is not None and fault.target == "agent" else os.getpid(), sig)
    elif fault.kind == "exit":
        os._exit(fault.code)
    elif fault.kind == "hang":
        while True:
            time.sleep(3600)
    elif fault.kind == "kill_node" and agent is not None:
        # the workers are the agent's children, or under ftsdp.launch its fork server's
        siblings = {*_children(agent), *_children(os.getppid())}
        os.kill(agent, signal.SIGKILL)
        for pid in siblings:
            if pid != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
