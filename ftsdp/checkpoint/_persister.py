"""The snapshot persister (docs/elastic.md, "Snapshots through a persister"): a process started
by rank 0 that turns the slots the ranks copied into shared memory into committed steps. Over
its control socket (JSON lines) a rank says ``hello`` (its rows; answered ``slots`` once every
rank's arrived) and ``saved`` (a slot holds a step; answered ``done`` once it is free again)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import queue
import select
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, replace
from typing import Any

from ftsdp import storage
from ftsdp.storage.saving import RootForRanks, object_checksums, plan_for_ranks

logger = logging.getLogger(__name__)
SOCKET, LAYOUT = "persister.sock", "layout.json"


def slot_file(folder: str, rank: int, slot: int, i: int) -> str:
    return os.path.join(folder, f"r{rank}.s{slot}.o{i}")


def record_file(folder: str, rank: int, slot: int) -> str:
    return os.path.join(folder, f"r{rank}.s{slot}.json")


def save_options(doc: dict[str, Any]) -> storage.SaveOptions:
    """``SaveOptions`` from its ``asdict`` form."""
    return storage.SaveOptions(**{**doc, "io": storage.IOOptions(**doc["io"])})


@contextlib.contextmanager
def socket_address(folder: str) -> Iterator[str]:
    """The control socket's address in ``folder``, through a descriptor of the folder: a Unix
    socket's path is limited to 107 bytes, a user's memory root is not."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{SOCKET}"
    finally:
        os.close(fd)


def write_private(path: str, data: bytes) -> None:
    """``data`` at ``path`` (mode 0600), replacing it atomically."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class _Slots:
    """The slot files of every rank, mapped read-only."""

    def __init__(
        self, folder: str, plans: list[Any], slots: tuple[int, ...] = (0, 1), make: bool = True
    ) -> None:
        """``make``: create the files that are not laid out as planned; else map them as they
        are (their checksums then refuse one that is not)."""
        self.paths: dict[tuple[int, int, int], str] = {}
        self.views: dict[tuple[int, int, int], memoryview] = {}
        for rank, plan in enumerate(plans):
            for i, obj in enumerate(plan.own(rank)):
                for slot in slots:
                    path = slot_file(folder, rank, slot, i)
                    self.paths[rank, slot, i] = path
                    made = _prepared(path, obj.head, obj.size) if make else _map(path, obj.size)
                    self.views[rank, slot, i] = made

    def answer(self, plans: list[Any], rank: int) -> list[Any]:
        """Rank ``rank``'s files: per object its two paths, size and piece byte ranges."""
        out = []
        for i, obj in enumerate(plans[rank].own(rank)):
            pieces = [
                [p.name, p.offset, p.length, s, e]
                for p, (s, e) in zip(obj.pieces, obj.byte_ranges, strict=True)
            ]
            out.append([self.paths[rank, 0, i], self.paths[rank, 1, i], obj.size, pieces])
        return out


def _prepared(path: str, head: bytes, size: int) -> memoryview:
    """File ``path`` of ``size`` bytes starting with ``head`` (kept when it already is one: a
    committed memory step may link to it), mapped read-only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_size == size and f.read(len(head)) == head:
                return _map(path, size)
    except FileNotFoundError:
        pass
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a new inode: a step linking the old file keeps its bytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+b") as f:
        f.truncate(size)
        f.write(head)
    return _map(path, size)


def _map(path: str, size: int) -> memoryview:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def _checksums(
    pool: ThreadPoolExecutor, slots: _Slots, plans: list[Any], slot: int, block: int
) -> list[list[Any]]:
    """Each rank's checksums per object index (the same under any attempt's names)."""
    futures = {
        (r, i): pool.submit(object_checksums, obj, slots.views[r, slot, i], block)
        for r, plan in enumerate(plans)
        for i, obj in enumerate(plan.own(r))
    }
    out: list[list[Any]] = [[] for _ in plans]
    for (r, _), fut in sorted(futures.items()):
        out[r].append(fut.result())
    return out


def commit_to_memory(
    root: RootForRanks,
    step: int,
    rows: list[Any],
    options: storage.SaveOptions,
    paths: dict[tuple[int, int, int], str],
    slot: int,
    crcs: list[list[Any]],
    values: list[dict[str, Any]],
) -> None:
    """Commit ``step`` from ``slot``'s files to the memory root by hard links, keeping only it."""
    mem = replace(options, keep_last=1, keep_every=None, discard_newer=True)
    with root.begin(step, rows, mem) as saved:  # a failure removes the links it made
        named = []
        for r in range(len(rows)):
            objs = saved.objects(r)
            for i, obj in enumerate(objs):
                saved.link(obj, paths[r, slot, i])
            named.append({o.name: crcs[r][i] for i, o in enumerate(objs)})
        saved.commit(named, values)


def recover(folder: str, memory_url: str) -> tuple[list[int], list[str]]:
    """Commit to the memory root each slot every rank finished copying that is newer than the
    tier's newest step (its persister died first): the steps committed, and why others were
    not. Run by rank 0 before a resume lists the memory tier, while no persister runs; it never
    raises (the other ranks wait for rank 0)."""
    committed: list[int] = []
    problems: list[str] = []
    try:
        with open(os.path.join(folder, LAYOUT), "rb") as f:
            layout = json.load(f)
        rows, world = layout["rows"], len(layout["rows"])
        options = save_options(layout["options"])
        found = [r for slot in (0, 1) if (r := _complete(folder, slot, world, layout["id"]))]
        try:
            newest = max(storage.list_steps(memory_url), default=-1)
        except FileNotFoundError:
            newest = -1
        plans = plan_for_ranks(rows, 0, options)  # the objects' layout
    except FileNotFoundError:
        return committed, problems  # no snapshot was ever laid out here
    except Exception as e:
        return committed, [f"{os.path.join(folder, LAYOUT)}: {type(e).__name__}: {e}"]
    root = RootForRanks(memory_url)
    for step, slot, values in sorted(found):
        if step <= newest:
            continue  # committed, or older than a committed one (its commit would discard that)
        try:
            slots = _Slots(folder, plans, (slot,), make=False)
            with ThreadPoolExecutor(4) as pool:
                crcs = _checksums(pool, slots, plans, slot, options.checksum_block_bytes)
            commit_to_memory(root, step, rows, options, slots.paths, slot, crcs, values)
            committed.append(step)
        except Exception as e:
            problems.append(f"step {step} in slot {slot}: {type(e).__name__}: {e}")
    return committed, problems


def _complete(folder: str, slot: int, world: int, layout: str) -> Any:
    """``(step, slot, each rank's values)`` when every rank's record of ``slot`` names the same
    step of ``layout``; else None."""
    records = []
    for rank in range(world):
        try:
            with open(record_file(folder, rank, slot), "rb") as f:
                records.append(json.load(f))
        except (FileNotFoundError, ValueError):
            return None
    if {(r.get("step"), r.get("layout")) for r in records} != {(records[0]["step"], layout)}:
        return None
    return records[0]["step"], slot, [r["memory_values"] for r in records]


class Persister:
    """The persister process's state: its connections, the layout, the steps in progress."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.folder = config["dir"]
        self.world = config["world"]
        self.options = save_options(config["options"])
        self.durable = RootForRanks(config["durable"], config.get("storage_options"))
        self.memory = None if config["memory"] is None else RootForRanks(config["memory"])
        self.inbox: queue.Queue[tuple[Any, dict[str, Any] | None]] = queue.Queue()
        self.conns: dict[int, Any] = {}
        self.rows: dict[int, Any] = {}
        self.layout: tuple[list[Any], list[Any], _Slots] | None = None  # rows, plans, slots
        self.layout_id = ""  # random: a record of an earlier persister's layout never matches
        self.pending: dict[int, dict[int, dict[str, Any]]] = {}  # step -> rank -> saved message
        self.durable_jobs: queue.Queue[Any] = queue.Queue()
        self.pool = ThreadPoolExecutor(self.options.io.threads, "persister")
        self.send_lock = threading.Lock()

    def serve(self) -> None:
        """Accept the ranks, then handle their messages in order until ``stop``."""
        path = os.path.join(self.folder, SOCKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            with socket_address(self.folder) as address:
                listener.bind(address)  # 0600, in a 0700 directory
        finally:
            os.umask(old)
        listener.listen(64)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        threading.Thread(target=self._durable_worker, daemon=True).start()
        while True:
            conn, msg = self.inbox.get()
            if msg is None:
                continue
            if msg["op"] == "stop":
                self.durable_jobs.put(None)
                self.durable_jobs.join()
                self._send(conn, {"op": "stopped"})
                return
            if msg["op"] == "hello":
                self._hello(conn, msg)
            elif msg["op"] == "saved":
                self._saved(msg)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            if int.from_bytes(creds[4:8], sys.byteorder) != os.geteuid():
                conn.close()  # another user's process (the directory should have kept it out)
                continue
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn.makefile("rb") as f:
            for line in f:
                self.inbox.put((conn, json.loads(line)))
        self.inbox.put((conn, None))

    def _send(self, conn: Any, msg: dict[str, Any]) -> None:
        with self.send_lock, contextlib.suppress(OSError):  # a rank gone: its restart says why
            conn.sendall(json.dumps(msg).encode() + b"\n")

    def _hello(self, conn: Any, msg: dict[str, Any]) -> None:
        rank = msg["rank"]
        self.conns[rank], self.rows[rank] = conn, msg["rows"]
        if len(self.rows) < self.world:
            return
        rows = [self.rows[r] for r in range(self.world)]
        self.rows = {}
        self.pending.clear()
        self.durable_jobs.join()  # the slots change: nothing may still read them
        try:
            plans = plan_for_ranks(rows, 0, self.options)
            slots = _Slots(self.folder, plans)
        except Exception as e:
            for c in self.conns.values():
                self._send(c, {"op": "slots", "error": f"{type(e).__name__}: {e}"})
            return
        self.layout_id = uuid.uuid4().hex
        self.layout = rows, plans, slots
        doc = {"id": self.layout_id, "rows": rows, "options": asdict(self.options)}
        write_private(os.path.join(self.folder, LAYOUT), json.dumps(doc).encode())
        protect = _newest_slot(self.folder)
        for r, c in self.conns.items():
            files = slots.answer(plans, r)
            reply = {"op": "slots", "layout": self.layout_id, "files": files, "protect": protect}
            self._send(c, reply)

    def _saved(self, msg: dict[str, Any]) -> None:
        step, rank = msg["step"], msg["rank"]
        self.pending.setdefault(step, {})[rank] = msg
        for older in [s for s in self.pending if s < step and rank not in self.pending[s]]:
            self._finish(self.pending.pop(older), "not saved by every rank")  # never complete
        if len(self.pending.get(step, {})) < self.world:
            return
        saved = self.pending.pop(step)
        if self.layout is None or any(m["layout"] != self.layout_id for m in saved.values()):
            self._finish(saved, "saved under another layout")
            return
        rows, plans, slots = self.layout
        slot = saved[0]["slot"]
        errors: dict[str, str | None] = {"memory": None, "durable": None}
        crcs = None  # computed here for the memory tier, else as the durable root is written
        if self.memory is not None and saved[0]["memory"]:
            values = [{**saved[r]["values"], **saved[r]["memory_extra"]} for r in range(self.world)]
            try:
                block = self.options.checksum_block_bytes
                crcs = _checksums(self.pool, slots, plans, slot, block)
                commit_to_memory(
                    self.memory, step, rows, self.options, slots.paths, slot, crcs, values
                )
            except Exception as e:
                errors["memory"] = f"{type(e).__name__}: {e}"
        if saved[0]["durable"]:
            self.durable_jobs.put((saved, slot, crcs, errors))
        else:
            self._finish(saved, None, errors)

    def _durable_worker(self) -> None:
        while True:
            job = self.durable_jobs.get()
            try:
                if job is None:
                    return
                saved, slot, crcs, errors = job
                try:
                    self._write_durable(saved, slot, crcs)
                except Exception as e:
                    errors["durable"] = f"{type(e).__name__}: {e}"
                    logger.warning("persister: step %d: %s", saved[0]["step"], errors["durable"])
                self._finish(saved, None, errors)
            finally:
                self.durable_jobs.task_done()

    def _write_durable(
        self, saved: dict[int, dict[str, Any]], slot: int, crcs: list[Any] | None
    ) -> None:
        assert self.layout is not None
        rows, _, slots = self.layout
        first = saved[0]
        options = replace(
            self.options,
            keep_last=first["keep_last"],
            keep_every=first["keep_every"],
            discard_newer=first["discard_newer"],
        )
        with self.durable.begin(first["step"], rows, options) as job:  # a failure removes
            writes = {  # the objects it wrote
                (r, i): self.pool.submit(job.write, obj, slots.views[r, slot, i], crcs is None)
                for r in range(self.world)
                for i, obj in enumerate(job.objects(r))
            }
            wait(writes.values())  # none in flight when a failure cleans up
            named: list[dict[str, Any]] = [{} for _ in range(self.world)]
            for (r, i), w in writes.items():
                written = w.result()
                named[r][job.objects(r)[i].name] = written if crcs is None else crcs[r][i]
            job.commit(named, [saved[r]["values"] for r in range(self.world)])

    def _finish(self, saved: dict[int, Any], error: str | None, errors: Any = None) -> None:
        """Tell the ranks of ``saved`` that its slot is free, with what became of the step."""
        errors = errors or {"memory": error, "durable": error}
        for r, m in saved.items():
            reply = {"op": "done", "step": m["step"], "slot": m["slot"], **errors}
            self._send(self.conns.get(r), reply)


def _newest_slot(folder: str) -> int | None:
    """The slot whose record (rank 0's) holds the newest step: the ranks fill the other first,
    so that a committed memory step is not overwritten while it is the newest."""
    steps = {}
    for slot in (0, 1):
        with (
            contextlib.suppress(FileNotFoundError, ValueError, KeyError),
            open(record_file(folder, 0, slot), "rb") as f,
        ):
            steps[slot] = json.load(f)["step"]
    return max(steps, key=steps.__getitem__) if steps else None


def _die_with(parent: int) -> None:
    """SIGKILL this process when the thread that started it ends (Linux), or at once when its
    parent ``parent`` is gone already."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _commit_only_under(pid: int | None) -> None:
    """Refuse every commit of this process once process ``pid`` is gone: the one that started
    rank 0 (torchrun's agent), so that a job whose agent died commits nothing more here either
    (docs/elastic.md, "A worker without its agent"); the persister then exits."""
    if pid is None:
        return
    try:
        fd = os.pidfd_open(pid)  # names that process, not a later one with its pid
    except (AttributeError, OSError):
        return  # no pidfds (not Linux 5.3+), or gone already: rank 0 is leaving too

    def check() -> None:
        if select.select([fd], [], [], 0)[0]:
            logger.error("the job's agent (pid %d) is gone: committing nothing more", pid)
            os._exit(1)

    storage.saving.guard_commits(check)


def main() -> None:
    """The persister process (started by ``Snapshots``): its configuration as JSON on stdin."""
    config = json.loads(sys.stdin.readline())
    _die_with(config["parent"])
    _commit_only_under(config.get("agent"))
    # A job's SIGTERM or Ctrl-C reaches every process: the persister finishes what the ranks
    # ask (their last save) and ends with rank 0 (PR_SET_PDEATHSIG) or when it says stop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="ftsdp persister: %(message)s")
    Persister(config).serve()
