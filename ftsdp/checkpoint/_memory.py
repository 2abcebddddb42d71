"""The memory tier: a node-local cache of the newest steps in host shared memory, in a root only
this user can reach (docs/elastic.md, "A memory tier"; docs/format.md, "On a shared machine")."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ftsdp import storage
from ftsdp.checkpoint._tier import Tier

NODE_ENV = "FTSDP_NODE"  # overrides _machine(): e.g. to simulate several nodes on one machine


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
    """A local root only this user can reach (a directory owned by the effective uid, mode 0700,
    not a link), its identity checked before each use, so a path swapped meanwhile is refused."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)  # not resolved: a link at the path must be seen
        self.fd: int | None = None  # held while in use: the inode cannot be reused meanwhile

    def problem(self) -> str | None:
        """Why the root must not be used now (opening it first, creating it when absent); None
        when it is this user's private directory, the one opened first."""
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
    """Why the existing local root ``url`` is not a private root of this user, without creating
    or opening it (None: it is, it is absent, or ``url`` is not a local path)."""
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
        if not self.on:
            return
        rank, world = self.group.rank_world()
        if world > 1:
            dist.barrier(group=self.group.pg)
        if not self._private():  # a link to the durable root would have it cleared
            return
        try:
            if self.node is not None:  # one rank per machine clears its own
                storage.saving.clear_on_nodes(self.url, node=self.node, process_group=self.group.pg)
            elif rank == 0:
                storage.catalog.clear_steps(self.url)
        except OSError as e:
            self.log(f"ftsdp: clearing the memory tier {self.url} failed: {e}")
        self._off()
