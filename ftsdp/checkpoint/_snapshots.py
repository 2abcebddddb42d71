"""Snapshots through the persister, the training side (docs/elastic.md, "Snapshots through a
persister"): a save copies this rank's tensors into one of its two slots in shared memory,
records it and tells the persister (``_persister.py``), which does the rest."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import multiprocessing
import operator
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Any

import torch

from ftsdp import storage
from ftsdp.checkpoint import _persister as p
from ftsdp.checkpoint._tiers import (
    MemoryTier,
    PrivateRoot,
    RootInUseError,
    Tier,
    _local_path,
    _machine,
    _place,
)
from ftsdp.storage.io import all_reduce_max, resolve_group

_LOCK = "lock"  # the slot folder's lock file: one job at a time (Snapshots._claim_or_raise)

logger = logging.getLogger(__name__)
# a slot's copy: (contiguous sources' pieces, their views in the slot, (tensor, start, length,
# view) of the pieces cut at each copy)
_Plan = tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[torch.Tensor, int, int, Any]]]
_CONNECT_TIMEOUT_S = 120.0  # the persister imports torch before it listens


class Snapshots:
    """This rank's side of the persister: its slots, its connection, the saves in flight."""

    def __init__(
        self,
        durable: Tier,
        memory: MemoryTier | None,
        options: storage.SaveOptions | None,
    ) -> None:
        self.durable, self.memory, self.group = durable, memory, durable.group
        self.log = durable.log
        self.options = options or storage.SaveOptions()
        self.on: bool | None = None  # decided by start(): one machine, plain local roots
        self.folder = ""
        self.proc: subprocess.Popen[bytes] | None = None  # rank 0's persister
        self._lock_fd: int | None = None  # rank 0's lock on the slot folder (_claim_or_raise)
        self.conn: socket.socket | None = None
        self.buffer = bytearray()
        self.lost = False
        self.starting = False  # memory snapshots skipped until the persister listens
        self.copying: _Copy | None = None  # a deferred save's copy, until wait_copy()
        self._copier: storage.saving.Worker | None = None  # the deferred copies' kept thread
        self.fence_seconds = 0.0  # time wait_copy() blocked, in total
        self.layout: str | None = None
        self.rows: list[Any] | None = None
        self.views: list[list[tuple[str, int, int, torch.Tensor]]] = [[], []]
        # kept while a save hands over the same leaves (objects): their rows, and per slot the
        # copy plan (the sources' pieces and the slot's views), made again with the slots
        self._kept_leaves: list[Any] = []
        self._kept_rows: list[Any] | None = None
        self._plans: list[_Plan | None] = [None, None]
        self.maps: list[mmap.mmap] = []
        self.cuda = False  # a saved tensor is on CUDA (decided with the slots, at the hello)
        self.pinned: list[int] = []  # addresses of the slots page-locked for copies from CUDA
        self.busy: dict[int, tuple[int, bool, bool]] = {}  # slot -> (step, durable, memory)
        self.protect: int | None = None  # the slot of the newest memory snapshot
        self.last_slot = 1
        self.errors: list[str] = []  # durable saves that failed, raised at the next save
        self.discarding: int | None = None  # the durable step sent to discard the newer ones
        self.newest: dict[str, int] = {}  # "durable" / "memory" -> newest committed step

    # -- starting -----------------------------------------------------------------------------

    def start(self) -> bool:
        """Decide whether the persister is used (collective, once); rank 0 commits what a dead
        persister left complete in the memory tier, then starts a persister."""
        if self.on is not None:
            return self.on
        rank, world = self.group.rank_world()
        here = _machine()
        whole = world == 1 or (
            torch.distributed.get_world_size(self.group.pg) == torch.distributed.get_world_size()
        )
        local = self.memory is None or _local_path(self.memory.url) is not None
        same = self.group.from_rank0(lambda: here) == here
        self.on = self.group.agree(0 if (same and whole and local) else 1) == 0
        if not self.on:
            self.log(
                "ftsdp: snapshots are saved in each rank's process (the persister needs every "
                "rank on one machine and a local memory tier)"
            )
            return False
        if self.memory is not None:
            ok = self.memory._private()  # collective
            mem_path = _local_path(self.memory.url)
            assert mem_path is not None
            self.folder = os.path.join(mem_path, "slots")
            if rank == 0 and ok:
                os.makedirs(self.folder, mode=0o700, exist_ok=True)
            self._claim_or_raise(ok)
            if rank == 0 and ok:
                committed, problems = p.recover(self.folder, self.memory.url)
                if committed:
                    self.log(
                        f"ftsdp: snapshot steps {committed} were complete in shared memory but "
                        "not committed (their persister died first): committed now"
                    )
                for problem in problems:
                    self.log(f"ftsdp: a snapshot in shared memory is not used: {problem}")
            self.on = ok
        else:
            # One folder per user and checkpoint root, the same for every incarnation: a crashed
            # job's slots are reused by its restart, not left behind in memory.
            where = hashlib.sha256(_place(self.durable.url).encode()).hexdigest()[:16]
            name = f"ftsdp-{os.geteuid()}-snapshots-{where}"
            self.folder = os.path.join(_shm() or tempfile.gettempdir(), name)
            root = PrivateRoot(self.folder)
            why = root.problem()  # made 0700 when absent; else this user's and private
            root.close()
            self.on = self.group.agree(0 if why is None else 1) == 0
            if not self.on:
                why = why or "it failed a check on another rank"
                self.log(
                    f"ftsdp: the snapshot folder {self.folder} is not usable ({why}): saves run "
                    "in each rank's process"
                )
            self._claim_or_raise(bool(self.on))
        if self.on and rank == 0:
            self._spawn()
        return bool(self.on)

    def _claim_or_raise(self, usable: bool) -> None:
        """Rank 0 locks the slot folder for the process's life (``flock``); RootInUseError on
        every rank when another live job holds it (collective)."""
        held = False
        if usable and self.group.rank_world()[0] == 0:
            flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
            fd = os.open(os.path.join(self.folder, _LOCK), flags, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
            except BlockingIOError:
                os.close(fd)
                held = True
        if self.group.agree(1 if held else 0):
            raise RootInUseError(
                f"another job is saving to {self.durable.url} from this machine: its snapshot "
                f"persister holds {self.folder} (or a CheckpointManager of this process that "
                "was not closed does). Two jobs must not share a checkpoint root: stop one of "
                "them (close() the manager), or give each its own checkpoint URL"
            )

    def _spawn(self) -> None:
        config = {
            "dir": self.folder,
            "world": self.group.rank_world()[1],
            "options": asdict(self.options),
            "durable": self.durable.url,
            "storage_options": self.durable.storage_options,
            "memory": None if self.memory is None else self.memory.url,
            "parent": os.getpid(),
            "agent": _starter(),  # commits stop when it is gone (_persister._commit_only_under)
        }
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.folder, p.SOCKET))  # not to connect to a dead one
        self.proc = subprocess.Popen(persister_command(), stdin=subprocess.PIPE)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config).encode() + b"\n")
        self.proc.stdin.close()

    def _connect(self, wait: bool = True) -> None:
        """Connect to the persister: waiting until it listens, or (``wait`` False) trying once."""
        path = os.path.join(self.folder, p.SOCKET)
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                st = os.lstat(path)
                if st.st_uid != os.geteuid():
                    raise storage.CheckpointError(
                        f"{path} belongs to uid {st.st_uid}: not this user's persister"
                    )
                with p.socket_address(self.folder) as address:
                    sock.connect(address)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if not wait:
                    return
                if self.proc is not None and self.proc.poll() is not None:
                    raise storage.CheckpointError(
                        f"the snapshot persister exited with code {self.proc.returncode} before "
                        "it listened (its error is above)"
                    ) from None
                if time.monotonic() > deadline:
                    raise storage.CheckpointError(
                        f"no snapshot persister answered at {path} in {_CONNECT_TIMEOUT_S:.0f}s"
                    ) from None
                time.sleep(0.02)
        self.conn, self.lost = sock, False
        self.buffer.clear()

    def _hello(self, rows: list[Any], leaves: dict[str, Any]) -> None:
        """Send this rank's rows; map the slot files the persister answers with."""
        if self.conn is None:
            self._connect()
        rank = self.group.rank_world()[0]
        self._send({"op": "hello", "rank": rank, "rows": rows})
        while (msg := self._receive(block=True)) is not None and msg["op"] != "slots":
            pass
        if msg is None:
            raise storage.CheckpointError("the snapshot persister died during the set-up")
        if "error" in msg:
            raise storage.CheckpointError(
                f"the snapshot persister refused the state: {msg['error']}"
            )
        self._unmap()
        for path0, path1, size, pieces in msg["files"]:
            for slot, path in ((0, path0), (1, path1)):
                mm = _open_slot(path, size)
                self.maps.append(mm)
                for name, offset, length, start, _ in pieces:
                    leaf = leaves[name]
                    dst = torch.frombuffer(mm, dtype=leaf.dtype, count=length, offset=start)
                    self.views[slot].append((name, offset, length, dst))
        self.layout, self.rows, self.busy = msg["layout"], rows, {}
        self.protect = msg["protect"]
        self.cuda = any(leaf.local.device.type == "cuda" for leaf in leaves.values())
        if self.cuda:
            self._pin()

    def _pin(self) -> None:
        """Page-lock the slots for copies from CUDA (docs/elastic.md); a slot CUDA refuses to
        lock is copied into as it is."""
        for mm in self.maps:
            ptr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
            err = int(torch.cuda.cudart().cudaHostRegister(ptr, len(mm), 0))
            if err == 0:
                self.pinned.append(ptr)
            else:
                logger.warning("ftsdp: could not page-lock a snapshot slot (CUDA error %d)", err)

    def _unmap(self) -> None:
        self.views = [[], []]
        self._plans = [None, None]
        pinned, self.pinned = self.pinned, []
        for ptr in pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        maps, self.maps = self.maps, []
        for mm in maps:
            with contextlib.suppress(BufferError):  # a view still alive: freed with it
                mm.close()

    # -- messages -----------------------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            assert self.conn is not None
            self.conn.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            self.lost = True

    def _receive(self, block: bool) -> dict[str, Any] | None:
        """One message (None: none waiting, or the persister is gone: ``lost``)."""
        while b"\n" not in self.buffer:
            if self.conn is None or self.lost:
                return None
            try:  # the socket stays blocking: a copy thread may be sending on it
                data = self.conn.recv(1 << 16, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError:
                data = b""
            if not data:
                self.lost = True
                return None
            self.buffer += data
        cut = self.buffer.index(b"\n")
        msg = json.loads(bytes(self.buffer[:cut]))
        del self.buffer[: cut + 1]
        if msg["op"] == "done":
            self._done(msg)
        return msg

    def _done(self, msg: dict[str, Any]) -> None:
        step, durable, memory = self.busy.pop(msg["slot"], (msg["step"], False, False))
        if durable:
            if msg["durable"] is None:
                self.newest["durable"] = max(step, self.newest.get("durable", -1))
                self.durable.newest = self.newest["durable"]
                if self.durable.seen is not None:
                    self.durable.seen.add(step)
            else:
                self._failed(step, f"saving step {step} to {self.durable.url}: {msg['durable']}")
        if memory:
            assert self.memory is not None  # a memory snapshot was sent
            if msg["memory"] is None:
                self.newest["memory"] = max(step, self.newest.get("memory", -1))  # (any order)
                self.memory.note_success()
            else:
                self.memory.log_cache_failure(f"step {step}: {msg['memory']}")

    def _drain(self) -> None:
        while self._receive(block=False) is not None:
            pass

    def _wait_free(self, slot: int | None = None) -> None:
        """Block until ``slot`` (None: every slot) is free again, or the persister is gone."""
        while (self.busy if slot is None else slot in self.busy) and not self.lost:
            self._receive(block=True)
        if self.lost:
            for step, durable, _ in self.busy.values():
                if durable:
                    self._failed(step, f"the snapshot persister died before committing step {step}")
            self.busy.clear()

    def _failed(self, step: int, error: str | None = None) -> None:
        """The durable save of ``step`` failed: ``error`` raised at the next save, the step
        saved again, and the newer steps still to discard when it was to discard them."""
        if error is not None:
            self.errors.append(error)
        self.durable.failed = step
        if step == self.discarding:  # the newer steps are still there
            self.durable.discard_newer = True

    # -- saving -------------------------------------------------------------------------------

    def save(
        self,
        state: dict[str, Any],
        step: int,
        *,
        durable: bool,
        memory: bool,
        memory_values: dict[str, Any],
        block: bool = False,
        defer: bool = False,
    ) -> bool | None:
        """Snapshot ``state`` as ``step`` for the durable root (``durable``) and the memory tier
        (``memory``); collective. ``block``: return once committed. Raises an earlier durable
        save's error (on every rank). ``defer``: copy on a thread (:meth:`wait_copy` before the
        saved tensors change). False: a memory snapshot skipped while the persister starts.
        None: the persister could not take the state (its slots: a full memory tier), it is
        stopped, and the caller saves in its own process."""
        self.wait_copy()
        leaves, values = storage.saving.describe(state)
        rows = self._rows(leaves)
        self._drain()
        if self.proc is not None and self.proc.poll() is not None:
            self.lost = True
        if self.conn is None:
            self._connect(wait=False)
        lost, changed, failed, absent = all_reduce_max(
            [int(self.lost), int(rows != self.rows), int(bool(self.errors)), int(not self.conn)],
            resolve_group(self.group.pg),
        )
        if failed:
            self._wait_free()
            errors, self.errors = self.errors, []
            error = "; ".join(errors) or "a save to the durable root failed on another rank"
            self.durable.report_failure(storage.CheckpointError(error))  # raises (durable)
        if lost:
            self._restart()
        if (lost or absent) and not (durable or block):
            # A persister starting (after a restart: the interpreter and torch to import) is not
            # waited for by a memory snapshot: training goes on, the next one tries again.
            if self.group.rank_world()[0] == 0 and not self.starting:
                self.log(
                    f"ftsdp: the snapshot persister is starting: memory snapshot of step {step} skipped"
                )
            self.starting = True
            return False
        if self.conn is None:
            self._connect()
        self.starting = False
        if lost or changed or absent:  # (agreed above: every rank is here)
            why: Exception | None = None
            try:
                self._hello(rows, leaves)
            except storage.CheckpointError as e:
                why = e
            if self.group.agree(1 if why is not None else 0):
                self.log(
                    "ftsdp: the snapshot persister cannot hold this state "
                    f"({why or 'it failed on another rank'}): saves run in each rank's process "
                    "from now on"
                )
                self._shut()
                return None
        slot = 1 - self.protect if self.protect is not None else 1 - self.last_slot
        self._wait_free(slot)
        message = {
            "op": "saved",
            "rank": self.group.rank_world()[0],
            "step": step,
            "slot": slot,
            "layout": self.layout,
            "values": values,
            "memory_extra": memory_values,
            "durable": durable,
            "memory": memory and self.memory is not None,
            "keep_last": self.durable.keep_last,
            "keep_every": self.durable.keep_every,
            "discard_newer": self.durable.discard_newer,
        }
        self.busy[slot], self.last_slot = (step, durable, memory), slot
        if durable and self.durable.failed == step:  # tried again
            self.durable.failed = None
        if durable and self.durable.discard_newer:  # once, unless this save fails (_done)
            self.durable.discard_newer, self.discarding = False, step
        if memory:
            self.protect = slot
        plan = self._plan(slot, leaves)
        # CUDA: the copy waits for the work queued so far on the caller's stream
        sources = plan[0] or [local for local, *_ in plan[2]]
        ready = storage.saving.queued_work_event(sources) if self.cuda else None
        if defer and not block:  # the optimizer's next step waits for it (wait_copy)
            if self._copier is None:
                self._copier = storage.saving.Worker("ftsdp-snapshot")
            self.copying = _Copy(lambda: self._fill(slot, plan, message, ready))
            self._copier.submit(self.copying.run)
        else:
            self._fill(slot, plan, message, ready)
        if block:
            self.wait()
        return True

    def _rows(self, leaves: dict[str, Any]) -> list[Any]:
        """``leaf_rows(leaves)``, kept while the leaves are the same objects as the save before's
        (a ``TensorLeaf`` is not changed once made)."""
        now = list(leaves.values())
        same = len(now) == len(self._kept_leaves) and all(map(operator.is_, now, self._kept_leaves))
        if self._kept_rows is None or not same:
            self._kept_rows = storage.saving.leaf_rows(leaves)
            self._kept_leaves = now
            self._plans = [None, None]
        return self._kept_rows

    def _plan(self, slot: int, leaves: dict[str, Any]) -> _Plan:
        """The pieces of ``leaves`` this rank writes and their views in ``slot``, kept with the
        rows and the slots; a piece of a tensor that is not contiguous is cut at each copy."""
        plan = self._plans[slot]
        if plan is None:
            plan = ([], [], [])
            for name, offset, length, dst in self.views[slot]:
                leaf = leaves[name]
                start = offset - leaf.range.offset
                if leaf.local.is_contiguous():
                    plan[0].append(leaf.local.view(-1)[start : start + length])
                    plan[1].append(dst)
                else:
                    plan[2].append((leaf.local, start, length, dst))
            self._plans[slot] = plan
        return plan

    def _fill(self, slot: int, plan: _Plan, message: dict[str, Any], ready: Any) -> None:
        """Copy this rank's pieces into ``slot`` (``plan``: :meth:`_plan`), record it, tell the
        persister. ``ready``: ``storage.saving.queued_work_event`` of the sources (CUDA)."""
        record = p.record_file(self.folder, message["rank"], slot)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record)  # the slot holds no complete step from here to its new record
        sources, targets, cut = plan
        stream = storage.saving.side_stream(ready)
        on_stream = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with torch.no_grad(), on_stream:
            if targets:
                torch._foreach_copy_(targets, sources, non_blocking=stream is not None)
            for local, start, length, dst in cut:
                dst.copy_(
                    local.reshape(-1)[start : start + length], non_blocking=stream is not None
                )
        if stream is not None:
            stream.synchronize()
        values = {**message["values"], **message["memory_extra"]}
        doc = {"step": message["step"], "layout": self.layout, "memory_values": values}
        p.write_private(record, json.dumps(doc).encode())
        self._send(message)

    def wait_copy(self) -> None:
        """Block until the latest save's copy is done (before the saved tensors change)."""
        copying, self.copying = self.copying, None
        if copying is not None:
            start = time.perf_counter()
            copying.wait()
            self.fence_seconds += time.perf_counter() - start

    def _restart(self) -> None:
        """Every rank (collective): the persister is gone; rank 0 starts another."""
        lost = sorted(step for step, durable, _ in self.busy.values() if durable)
        for step in lost:
            self._failed(step)
        self.busy.clear()
        if self.conn is not None:
            self.conn.close()
        self.conn, self.layout, self.rows, self.lost = None, None, None, False
        if self.group.rank_world()[0] == 0:
            code = None if self.proc is None else self.proc.poll()
            self.log(
                f"ftsdp: THE SNAPSHOT PERSISTER DIED (exit code {code}): restarting it; durable "
                f"steps in flight, not committed: {lost or 'none'}; the checkpoint root holds "
                f"committed steps only (newest {self.newest.get('durable')})"
            )
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            self._spawn()

    def in_flight(self) -> bool:
        """Whether a save is still being copied, written or committed (never waits: a log line
        asks right after each save)."""
        self._drain()
        copying = self.copying is not None and not self.copying.done()
        return copying or bool(self.busy)

    def wait(self) -> None:
        """Block until every save sent is committed or failed; raise a durable failure."""
        self.wait_copy()
        self._wait_free()
        if self.errors:
            errors, self.errors = self.errors, []
            self.durable.report_failure(storage.CheckpointError("; ".join(errors)))

    def close(self) -> None:
        """Wait for the saves, stop the persister, remove the slots (rank 0, after a barrier)."""
        if not self.on:
            return
        try:
            self.wait()
        finally:
            self._shut()

    def _shut(self) -> None:
        """Stop the persister and remove the slots (rank 0, after a barrier); off from now on."""
        rank, world = self.group.rank_world()
        if rank == 0 and self.conn is not None and not self.lost:
            self._send({"op": "stop"})
            while (msg := self._receive(block=True)) is not None and msg["op"] != "stopped":
                pass
        self._unmap()
        if world > 1:
            torch.distributed.barrier(group=self.group.pg)
        if rank == 0:
            if self.proc is not None:
                if self.conn is None or self.lost:  # never asked to stop: it holds nothing
                    self.proc.kill()
                try:
                    self.proc.wait(_CONNECT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            _remove_own_files(self.folder)
            if self._lock_fd is not None:  # the lock file went with the folder's files
                os.close(self._lock_fd)
                self._lock_fd = None
        if self.conn is not None:
            self.conn.close()
        if self._copier is not None:  # its thread ends now, not after its idle time
            self._copier.stop()
            self._copier = None
        self.conn, self.on = None, False


class _Copy:
    """One deferred copy handed to the copier: :meth:`wait` until it is over (its error, if
    any, was logged: the persister then never hears of the save, which fails as not committed)."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self._over = threading.Event()

    def run(self) -> None:
        try:
            self.job()
        except Exception:
            logger.exception("ftsdp: the copy of a snapshot failed")
        finally:
            self._over.set()

    def done(self) -> bool:
        return self._over.is_set()

    def wait(self) -> None:
        self._over.wait()


def persister_command() -> list[str]:
    """The persister's command line. Python puts the working directory first on the path of a
    ``-c`` program, so a module another user planted there (a job started in a shared ``/tmp``)
    would run as this user before any of ours: ``-P`` (3.11+) leaves it out; before 3.11 the
    program takes it out before importing anything."""
    run = "from ftsdp.checkpoint._persister import main; main()"
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-c", run]
    return [sys.executable, "-c", f"import sys; del sys.path[0]; {run}"]


def _starter() -> int:
    """The process that started this one: torchrun's agent (the multiprocessing parent of a
    worker forked from ``ftsdp.launch``'s fork server), else the parent."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None and parent.pid else os.getppid()


def _open_slot(path: str, size: int) -> mmap.mmap:
    """Slot file ``path``, this user's and ``size`` bytes, mapped read-write."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_size != size:
            raise storage.CheckpointError(f"{path} is not this user's slot of {size} bytes")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _remove_own_files(folder: str) -> None:
    """The slot files, records, layout, socket and lock in ``folder`` (and the folder when it
    is empty then); nothing else."""
    own = (p.SOCKET, p.LAYOUT, _LOCK)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            if name in own or (name[:1] == "r" and ".s" in name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _shm() -> str | None:
    """``/dev/shm`` when this machine has one (the snapshots in memory), else the default."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
