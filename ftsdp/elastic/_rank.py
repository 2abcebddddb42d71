"""The rank manager: this process's place in the job, its process group (docs/elastic.md)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftsdp.elastic._teardown import CloseReport, close_process_groups
from ftsdp.elastic._watchdog import EXIT_STALL

logger = logging.getLogger(__name__)
_LEAVING = threading.Lock()  # one line, even when two threads find the agent gone at once
_POLL_S = 0.01  # the join handshake's store polls


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer") from None


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """This worker's place in the job, from torchrun's environment (or a world of one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0  # the agent (node) index in this rendezvous round
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT of this worker's agent
    max_restarts: int = 0
    run_id: str = "local"
    master_addr: str | None = None
    master_port: int | None = None
    torchrun: bool = False  # launched by torch.distributed.elastic

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        if not 0 <= self.local_rank < max(1, self.local_world_size):
            raise ValueError(
                f"LOCAL_RANK={self.local_rank} must be in [0, LOCAL_WORLD_SIZE="
                f"{self.local_world_size})"
            )
        if self.world_size > 1 and (self.master_addr is None or self.master_port is None):
            raise ValueError(
                f"WORLD_SIZE={self.world_size} but MASTER_ADDR/MASTER_PORT are not set: "
                "launch with torchrun"
            )


class LaunchEnvironmentError(ValueError):
    """torchrun's environment variables are not what torchrun sets: not integers, out of range,
    or a world of several ranks without a master address."""


def read_env(env: Mapping[str, str] | None = None) -> RankInfo:
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, ..., TORCHELASTIC_*, MASTER_*);
    absent variables default to a world of one. ``LaunchEnvironmentError`` says what is wrong."""
    env = os.environ if env is None else env
    try:
        world = _int(env, "WORLD_SIZE", 1)
        return RankInfo(
            rank=_int(env, "RANK", 0),
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            group_rank=_int(env, "GROUP_RANK", 0),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID") or "local",
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_int(env, "MASTER_PORT", 0) if env.get("MASTER_PORT") else None,
            torchrun="TORCHELASTIC_RUN_ID" in env,
        )
    except ValueError as e:
        raise LaunchEnvironmentError(str(e)) from None


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch.cuda.is_available() is False; use cpu")
        return torch.device("cuda", local_rank)
    if device != "cpu":
        raise ValueError(f"device={device!r} must be 'auto', 'cpu' or 'cuda'")
    return torch.device("cpu")


def client_store(addr: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """The job's TCPStore as torch's env:// rendezvous would open it: a client of torchrun's
    agent store (``TORCHELASTIC_USE_AGENT_STORE=True``), else hosted by rank 0."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return dist.TCPStore(
        addr,
        port,
        world_size,
        is_master=not agent and rank == 0,
        timeout=timedelta(seconds=timeout_s),
        multi_tenant=True,
    )


def _get(store: Any, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def handshake(store: Any, rank: int, world_size: int, timeout_s: float) -> str:
    """Agree on rank 0's fresh token, this incarnation's store namespace (docs/elastic.md);
    every rank of the group must call it."""
    deadline = time.monotonic() + timeout_s

    def waited(what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: no {what} within {timeout_s:g}s while joining the process group "
                f"(world size {world_size}): is every rank of this incarnation running?"
            )
        time.sleep(_POLL_S)

    if rank == 0:
        token = uuid.uuid4().hex[:12]
        answered: dict[int, str] = {}
        pending = set(range(1, world_size))
        while pending:
            for r in sorted(pending):
                nonce = _get(store, f"req/{r}")
                if nonce is not None and answered.get(r) != nonce:
                    store.set(f"ack/{r}", f"{token} {nonce}")
                    answered[r] = nonce
                if _get(store, f"ok/{r}") == token:
                    pending.discard(r)
            if pending:
                waited(f"answer from ranks {sorted(pending)}")
        return token
    nonce = uuid.uuid4().hex
    store.set(f"req/{rank}", nonce)
    while True:
        ack = _get(store, f"ack/{rank}")
        if ack is not None:
            token, _, echoed = ack.partition(" ")
            if echoed == nonce:
                store.set(f"ok/{rank}", token)
                return token
        waited("answer from rank 0")


class Agent:
    """The torchrun agent that started this worker, and whether it has exited (docs/elastic.md)."""

    def __init__(self) -> None:
        parent = multiprocessing.parent_process()
        ppid = os.getppid()
        self.pid = parent.pid if parent is not None and parent.pid else ppid
        self._poll: Any = None
        self._lock = threading.Lock()  # one poll() at a time: commits of two tiers ask at once
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfds here, or the agent has already exited
            self.pid = ppid
        else:
            self._poll = select.poll()
            self._poll.register(fd, select.POLLIN)

    def gone(self) -> bool:
        """Whether the agent has exited (one system call); from any thread."""
        if self._poll is None:
            return os.getppid() != self.pid
        with self._lock:  # a poll object refuses a second poll() while one runs
            return bool(self._poll.poll(0))


@dataclass(frozen=True, kw_only=True)
class Peer:
    """What every rank knows about every other after ``init`` (for logs and the watchdog)."""

    rank: int
    host: str
    pid: int
    restart_count: int


@dataclass(kw_only=True)
class RankManager:
    """This process's rank, world size, device, process group and the job's generation, from
    :meth:`init` to :meth:`close`; ``marks``: wall times of ``init``'s phases; ``agent``: under
    torchrun, the agent that started this worker (:meth:`exit_if_orphaned`), else None."""

    info: RankInfo
    device: torch.device
    generation: int = 0
    incarnation: str = ""
    peers: list[Peer] = field(default_factory=list)
    timeout_s: float = 600.0
    marks: dict[str, float] = field(default_factory=dict)
    agent: Agent | None = None
    _owns_group: bool = False
    _store: Any = None

    @classmethod
    def init(
        cls,
        *,
        device: str = "auto",
        timeout_s: float = 600.0,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RankManager:
        """Join the process group torchrun describes, or a world of one; ``timeout_s`` bounds every
        collective; ``threads``: torch CPU threads (default: the host's cores per local rank)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        info = read_env(env)
        agent = Agent() if info.torchrun else None
        dev = resolve_device(device, info.local_rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            if threads is None:  # ranks on one host share its cores
                cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
                count = len(cores) if cores is not None else os.cpu_count() or 1
                threads = max(1, count // max(1, info.local_world_size))
            torch.set_num_threads(threads)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        token = ""
        marks: dict[str, float] = {}
        owns = not dist.is_initialized()
        if owns:
            timeout = timedelta(seconds=timeout_s)
            if info.master_addr is not None and info.master_port is not None:
                # a fresh store namespace per incarnation (see handshake)
                base = client_store(
                    info.master_addr, info.master_port, info.rank, info.world_size, timeout_s
                )
                marks["store_connected"] = time.time()
                join = dist.PrefixStore(f"ftsdp/{info.run_id}/join/", base)
                token = handshake(join, info.rank, info.world_size, timeout_s)
                marks["joined"] = time.time()
                dist.init_process_group(
                    backend,
                    store=dist.PrefixStore(f"ftsdp/{info.run_id}/{token}/pg/", base),
                    rank=info.rank,
                    world_size=info.world_size,
                    timeout=timeout,
                )
            else:
                # one plain process: an in-memory store, and the same code path as under torchrun
                dist.init_process_group(
                    backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
                )
        elif dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
            raise ValueError(
                f"the process group already initialised has rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, the environment says {info.rank} of {info.world_size}"
            )
        manager = cls(info=info, device=dev, timeout_s=timeout_s, marks=marks, agent=agent)
        manager._owns_group = owns
        try:
            manager._agree_on_incarnation(token)
        except BaseException:
            manager.close(barrier=False)
            raise
        marks["process_group"] = time.time()
        return manager

    def _agree_on_incarnation(self, token: str) -> None:
        restarts = self.info.restart_count
        me = Peer(
            rank=self.rank, host=socket.gethostname(), pid=os.getpid(), restart_count=restarts
        )
        if self.rank == 0 and not token:
            token = uuid.uuid4().hex[:12]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (me, token))
        self.peers = [p for p, _ in gathered]
        self.incarnation = gathered[0][1]
        self.generation = max(p.restart_count for p in self.peers)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    def exit_if_orphaned(self) -> None:
        """Exit with ``EXIT_STALL`` and one log line if the torchrun agent is gone."""
        agent = self.agent
        if agent is None or not agent.gone():
            return
        with _LEAVING:  # never released: the process ends inside
            logger.error(
                f"ftsdp (rank {self.rank}): the torchrun agent (pid {agent.pid}) is gone: exiting "
                f"with {EXIT_STALL}, committing nothing more"
            )
            os._exit(EXIT_STALL)

    def agree_any(self, *flags: bool) -> tuple[bool, ...]:
        """Per flag, True on every rank if True on any (one all_reduce); call on every rank."""
        if self.world_size == 1:
            return tuple(bool(f) for f in flags)
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def store(
        self, prefix: str = "", timeout_s: float | None = None, *, run_wide: bool = False
    ) -> Any:
        """A client of the job's c10d store on a connection of its own, keys under this incarnation
        (``run_wide``: under the run, seen by every incarnation the agent restarts) and
        ``prefix``; None for a world of one without a master address."""
        if self.info.master_addr is None or self.info.master_port is None:
            return None
        if self._store is None:
            self._store = dist.TCPStore(
                self.info.master_addr,
                self.info.master_port,
                is_master=False,
                timeout=timedelta(seconds=timeout_s or self.timeout_s),
                wait_for_workers=False,
            )
        scope = "run" if run_wide else self.incarnation  # an incarnation's token is hex
        return dist.PrefixStore(f"ftsdp/{self.info.run_id}/{scope}/{prefix}", self._store)

    def close(self, *, barrier: bool | None = None, barrier_timeout_s: float = 60.0) -> CloseReport:
        """Leave the job, every rank at one point; destroy the groups :meth:`init` made (idempotent,
        docs/elastic.md). ``barrier`` None: skipped while an exception propagates; a CloseReport."""
        if barrier is None:
            barrier = sys.exc_info()[1] is None
        self._store = None  # our client of the job's store; the groups hold their own
        report = CloseReport()
        if self._owns_group and dist.is_initialized():
            report = close_process_groups(
                self.device, barrier=barrier, barrier_timeout_s=barrier_timeout_s
            )
        self._owns_group = False
        return report
