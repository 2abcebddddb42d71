"""The durable root and the memory tier, a private node-local cache (docs/elastic.md, "Tiers")."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

from ftsdp import storage
from ftsdp.storage.io import all_reduce_max, broadcast_json, rank_world, resolve_group

NODE_ENV = "FTSDP_NODE"  # overrides _machine(): e.g. to simulate several nodes on one machine


class Group:
    """The manager's process group (None: the default) and its agreements (JSON collectives)."""

    def __init__(self, process_group: Any) -> None:
        self.pg = process_group

    def rank_world(self) -> tuple[int, int]:
        """This rank and the world size (0, 1 without torch.distributed)."""
        return rank_world(resolve_group(self.pg))

    def from_rank0(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` (JSON-able, must not raise) on rank 0, its result on every rank."""
        group = resolve_group(self.pg)
        return broadcast_json(compute() if self.rank_world()[0] == 0 else None, group)

    def agree(self, code: int) -> int:
        """The largest ``code`` of every rank."""
        return all_reduce_max([code], resolve_group(self.pg))[0]


class RootInUseError(storage.CheckpointError):
    """A save failed because another job commits steps under the same checkpoint root;
    ``steps``: the other writer's steps it found there (none when a lock said so)."""

    def __init__(self, message: str, steps: list[int] | None = None) -> None:
        super().__init__(message)
        self.steps = steps or []


class Peek(NamedTuple):
    """What a step's manifest says before it is loaded (``Tier.peek``)."""

    optim_names: set[str] | None  # its ``optim.state.*`` names; None: the manifest is unreadable
    param_groups: Any  # the optimizer's param groups as saved (JSON), when there are any
    foreign: str | None  # why the step is not this run's; None: it is


class Tier:
    """One storage root: its saves (one in flight at a time), its committed steps, its loads."""

    cache = False  # True: errors are logged, never raised, and its steps never fatal
    name = "the checkpoint root"

    def __init__(
        self,
        url: str,
        group: Group,
        log: Callable[[str], None],
        *,
        keep_last: int | None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        options: storage.SaveOptions | None = None,
    ) -> None:
        self.url, self.group, self.log = url, group, log
        self.keep_last, self.keep_every = keep_last, keep_every  # retention after each commit
        self.storage_options, self.options = storage_options, options
        self.pending: storage.SaveHandle | None = None  # kept even when done: errors surface
        self.discard_newer = False  # the next save starts a new timeline here
        self._discarding = False  # the save in flight was to discard the newer steps
        self.failed: int | None = None  # the step of the newest save that failed (not retried)
        self.newest: int | None = None  # the newest step known to be committed here
        # every step this job knows committed here (those at its resume and its own): any
        # other met by a failed save is another writer's; None: no resume listed the root
        self.seen: set[int] | None = None
        self.resumed: int | None = None  # the step the job resumed from (any tier)
        self._failures = 0  # a cache's failed saves in a row (log_cache_failure)

    def values(self) -> dict[str, Any]:
        """JSON values this tier saves beside the manager's state (and loads back)."""
        return {}

    def foreign(self, step: int, values: dict[str, Any], durable: list[int]) -> str | None:
        """Why ``step`` (with its manifest's ``values``) is not this run's; None: it is (rank 0)."""
        return None

    def save(self, state: dict[str, Any], step: int, node: str | None = None, **kw: Any) -> None:
        """Start saving ``state`` as ``step`` (collective), raising the previous save's error."""
        self.wait()
        options = replace(
            self.options or storage.SaveOptions(),
            keep_last=self.keep_last,  # applied by the committing rank only
            keep_every=self.keep_every,
            discard_newer=self.discard_newer,
        )
        save = storage.save if node is None else partial(storage.saving.save_on_nodes, node=node)
        self.failed = None if self.failed == step else self.failed  # tried again
        try:
            self.pending = save(state, self.url, step, options=options, **self._where(), **kw)
        except (storage.CheckpointError, OSError) as e:  # FileExistsError among them
            self.failed = step
            self.report_failure(e)
        # once: after this save the newer steps are gone (unless it fails: wait())
        self._discarding, self.discard_newer = self.discard_newer, False

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error (a cache logs it)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        discarding, self._discarding = self._discarding, False
        try:
            pending.wait()
        except Exception as e:
            self.discard_newer = self.discard_newer or discarding  # the newer steps are still there
            self.failed = pending.step
            self.report_failure(e)
        else:
            self.newest = pending.step
            if self.seen is not None:
                self.seen.add(pending.step)
            self.note_success()

    def note_success(self) -> None:
        """A save committed: after failures of a cache, say that saves work again."""
        if self._failures:
            self.log(
                f"ftsdp: saves to {self.name} {self.url} work again (after {self._failures} "
                "failed in a row)"
            )
            self._failures = 0

    def _where(self) -> dict[str, Any]:
        """The process group and storage options of every storage call on this tier."""
        return {"process_group": self.group.pg, "storage_options": self.storage_options}

    def report_failure(self, error: Exception) -> None:
        """A save's error: raised (as :class:`RootInUseError` when another writer's steps are
        why), or logged by a cache."""
        if not self.cache:
            others = self._other_writers(error)
            if self.seen is not None and self.failed is not None:
                # a step this job tried to save may be committed, by this job (a commit whose
                # reply was lost) or not: it is never blamed on another writer later
                self.seen.add(self.failed)
            if others:
                raise RootInUseError(
                    f"another job is saving to {self.url}: step(s) {others} were committed "
                    "there by another writer while this job ran (this job "
                    + (
                        f"resumed from step {self.resumed}"
                        if self.resumed is not None
                        else "found no committed step when it started"
                    )
                    + "), so this job's save failed. Two jobs must not share a checkpoint "
                    "root: stop one of them, or give each its own checkpoint URL",
                    others,
                ) from error
            raise error
        self.log_cache_failure(str(error))

    def log_cache_failure(self, error: str) -> None:
        """A cache's failed save: the first logged whole, then the count at 10, 100, 1000..."""
        self._failures += 1
        n = self._failures
        if n == 1:
            self.log(f"ftsdp: a save to {self.name} {self.url} failed: {error}")
        elif n >= 10 and str(n).strip("0") == "1":
            self.log(
                f"ftsdp: saves to {self.name} {self.url} still fail: {n} in a row (the last: "
                f"{error})"
            )

    def _other_writers(self, error: Exception) -> list[int]:
        """The steps committed here at or after ``self.failed`` that this job did not know of,
        when ``error`` is a refusal they may explain (this rank lists the root); else []."""
        if self.seen is None or not isinstance(error, FileExistsError | storage.CheckpointError):
            return []
        try:
            steps = storage.list_steps(self.url, storage_options=self.storage_options)
        except Exception:  # the original error says more than a failed listing
            return []
        least = self.failed if self.failed is not None else -1
        return sorted(s for s in set(steps) - self.seen if s >= least)

    def newest_committed(self) -> int | None:
        """The newest step known to be committed, without waiting (errors left to :meth:`wait`)."""
        pending = self.pending
        if pending is not None and pending.done():
            try:
                pending.wait(0)
            except Exception:
                return self.newest
            self.newest = pending.step
        return self.newest

    def in_flight(self) -> bool:
        """Whether a save is still uploading or committing."""
        return self.pending is not None and not self.pending.done()

    def prepare(self, state: dict[str, Any]) -> None:
        """Storage's group and staging memory for deferred saves of ``state`` (collective)."""
        storage.saving.prepare_save(state, self.url, options=self.options, **self._where())

    def steps(self) -> list[int]:
        """The committed steps, as rank 0 lists them (collective)."""

        def listing() -> tuple[str, Any]:
            try:
                return "ok", storage.list_steps(self.url, storage_options=self.storage_options)
            except FileNotFoundError:
                return "ok", []
            except Exception as e:
                return "error", f"{type(e).__name__}: {e}"

        kind, value = self.group.from_rank0(listing)
        if kind == "ok":
            return list(value)
        if self.cache:
            self.log(f"ftsdp: listing {self.name} {self.url} failed on rank 0: {value}")
            return []
        raise storage.CheckpointError(
            f"listing the checkpoints under {self.url} failed on rank 0: {value}"
        )

    def peek(self, step: int, durable: list[int]) -> Peek:
        """What rank 0 reads in ``step``'s manifest (collective): see :class:`Peek`."""

        def peek() -> tuple[list[str] | None, Any, str | None]:
            try:
                m = storage.catalog.read_manifest(
                    self.url, step, storage_options=self.storage_options
                )
            except Exception:
                return None, None, None
            found = {*m.tensors, *m.values, *(k for values in m.rank_values for k in values)}
            names = sorted(n for n in found if n.startswith("optim.state."))
            groups = m.values.get("optim.param_groups")
            return names, groups, self.foreign(step, m.values, durable)

        names, groups, foreign = self.group.from_rank0(peek)
        return Peek(None if names is None else set(names), groups, foreign)

    def load(self, target: dict[str, Any], step: int, options: Any) -> storage.LoadResult:
        """``storage.load`` of ``step`` into ``target`` (collective, all-or-nothing)."""
        return storage.load(target, self.url, step, options=options, **self._where())

    def close(self) -> None:
        """Let go of what this process kept for its saves to the root (collective)."""
        storage.saving.release(self.url, storage_options=self.storage_options)


def _machine() -> str:
    """This machine as far as shared memory goes: host name and boot id, or ``$FTSDP_NODE``."""
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _place(url: str) -> str:
    """Where a root is: a local path (plain or ``file://``) resolved, a URL as written."""
    path = _local_path(url)
    return url.rstrip("/") if path is None else os.path.realpath(path)


class PrivateRoot:
    """A local root only this user can reach (a directory of the effective uid, mode 0700, not a
    link), its identity checked before each use."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)  # not resolved: a link at the path must be seen
        self.fd: int | None = None  # held while in use: the inode cannot be reused meanwhile

    def problem(self) -> str | None:
        """Why the root must not be used now (opened or made first); None: it is this user's."""
        try:
            if self.fd is None:
                self.fd = _open_private(self.path)
            held, now = os.fstat(self.fd), os.lstat(self.path)
        except OSError as e:
            if os.path.islink(self.path):  # O_NOFOLLOW's error: ELOOP, or ENOTDIR with O_DIRECTORY
                return "it is a symbolic link"
            return f"it cannot be opened as a directory ({e.strerror or e})"
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            return "something else was put at its path since it was opened (a link or a directory)"
        return unsafe(held)

    def close(self) -> None:
        """Let go of the descriptor."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open_private(path: str) -> int:
    """A descriptor of directory ``path``, made 0700 when absent; a link is not followed."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # exclusive: an existing path is checked, never adopted blindly
        made = True
    except FileExistsError:
        made = False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    if made and os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, 0o700)  # the umask may have taken owner bits away
    return fd


def unsafe(st: os.stat_result) -> str | None:
    """Why a directory with status ``st`` is not a private root of this user (None: it is)."""
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    if st.st_mode & 0o077:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users in (0700 is required)"
    return None


def root_problem(url: str) -> str | None:
    """Why the existing local root ``url`` is not this user's private root, without opening it."""
    path = _local_path(url)
    if path is None:
        return None
    try:
        return unsafe(os.lstat(path)) if not os.path.islink(path) else "it is a symbolic link"
    except FileNotFoundError:
        return None


def _local_path(url: str) -> str | None:
    """The path of a local root (plain or ``file://``); None for a URL of another filesystem."""
    path = url.removeprefix("file://")
    return None if "://" in path else path


class MemoryTier(Tier):
    """Saves to host shared memory beside ``durable``; a cache."""

    cache = True
    name = "the memory tier"

    def __init__(
        self, url: str, durable: Tier, *, options: storage.SaveOptions | None, **kw: Any
    ) -> None:
        if _place(url) == _place(durable.url):
            raise ValueError(
                f"CheckpointManager: memory_url={url!r} is the checkpoint root itself "
                f"({durable.url!r}): the memory tier keeps only memory_keep steps and close() "
                "clears it, which would delete the durable checkpoints; give it a root of its "
                "own (e.g. under /dev/shm)"
            )
        super().__init__(url, durable.group, durable.log, options=options, **kw)
        self.durable = durable
        self.on = True  # off after close, or over a subgroup on several machines
        self.node: str | None = None  # ranks on several machines: this rank's machine
        self.discard_newer = True  # the tier follows this run's timeline
        path = _local_path(url)  # another filesystem's URL (memory://) has no owner or mode
        self.root = None if path is None else PrivateRoot(path)

    def _private(self) -> bool:
        """Whether the root passes its checks on every rank (collective); else the tier is off."""
        why = None if self.root is None else self.root.problem()
        if self.group.agree(0 if why is None else 1) == 0:
            return True
        self.log(
            f"ftsdp: the memory tier {self.url} is off: {why or 'it failed a check on another rank'}"
            "; nothing in it is loaded or cleared (only durable checkpoints are used); give "
            "memory_url (--memory-url) a directory of your own with mode 0700, or remove this one"
        )
        self._off()
        return False

    def _off(self) -> None:
        self.on = False
        if self.root is not None:
            self.root.close()

    def values(self) -> dict[str, Any]:
        base = self.durable.newest_committed()
        return {"memory_tier": {"durable_step": -1 if base is None else base}}

    def save(self, state: dict[str, Any], step: int, node: str | None = None, **kw: Any) -> None:
        """An async :meth:`Tier.save`, once the root passed its checks again (collective)."""
        self.wait()
        if self._private():
            super().save(state, step, node=self.node, async_save=True, **kw)

    def foreign(self, step: int, values: dict[str, Any], durable: list[int]) -> str | None:
        """Another run's when it followed a durable step newer than any under the root."""
        base = values.get("memory_tier.durable_step")
        if not isinstance(base, int) or base < 0:
            return None  # saved before any durable commit (or by an older version)
        if durable and max(durable) >= base:
            return None
        return (
            f"ftsdp: CHECKPOINT STEP {step} AT {self.url} IS ANOTHER RUN'S: it was saved after "
            f"durable step {base}, and {self.durable.url} holds "
            + (f"only steps up to {max(durable)}" if durable else "no step")
            + " (the checkpoint root was replaced); passing it over"
        )

    def steps(self) -> list[int]:
        """Decide how the tier is shared (collective), then its committed steps."""
        if not self.on or not self._private() or not self._shared():
            return []
        if self.node is None:
            return super().steps()
        restored = storage.saving.restore_on_nodes(
            self.url, node=self.node, process_group=self.group.pg
        )
        return [] if restored is None else [restored]

    def load(self, target: dict[str, Any], step: int, options: Any) -> storage.LoadResult:
        """See :meth:`Tier.load`; refused when the root failed its checks since :meth:`steps`."""
        why = None if self.root is None else self.root.problem()
        if why is not None:
            raise storage.CheckpointError(f"the memory tier {self.url} is not loaded: {why}")
        return super().load(target, step, options)

    def _shared(self) -> bool:
        """Whether the tier is on: one root (``node`` None) or one per machine (``node`` set)."""
        here = _machine()
        same = self.group.from_rank0(lambda: here) == here
        self.node = None
        if self.group.agree(0 if same else 1) == 0:
            return True
        pg = self.group.pg
        if pg is not None and dist.get_world_size(pg) != dist.get_world_size():
            self.log(
                f"ftsdp: the memory tier {self.url} is off: the ranks are on more than one "
                "machine and the process group is a subgroup (node-local memory tiers need "
                "every rank of the job; only durable checkpoints are used)"
            )
            self._off()
            return False
        self.node = here
        return True

    def close(self) -> None:
        """Clear the tier (collective: every rank has finished its saves first)."""
        if not self.on:  # (turned off by agreement, maybe after saves: their lane goes)
            super().close()
            return
        rank, world = self.group.rank_world()
        if world > 1:
            dist.barrier(group=self.group.pg)
        if not self._private():  # a link to the durable root would have it cleared
            super().close()
            return
        try:
            if self.node is not None:  # one rank per machine clears its own
                storage.saving.clear_on_nodes(self.url, node=self.node, process_group=self.group.pg)
            elif rank == 0:
                storage.catalog.clear_steps(self.url)
        except OSError as e:
            self.log(f"ftsdp: clearing the memory tier {self.url} failed: {e}")
        super().close()
        self._off()
