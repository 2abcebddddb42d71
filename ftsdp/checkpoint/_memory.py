"""The memory tier: a node-local cache of the newest steps in host shared memory.

[Note: the memory tier]
A worker killed between two durable saves loses the steps since the last one; so with
``memory_url`` (``/dev/shm``: it outlives the worker, not the machine) the manager also saves
every ``memory_every`` steps there, in the same format, keeping ``memory_keep`` steps, in a
storage lane of its own (another root: a slow durable upload holds neither these saves nor the
optimizer's fence). Resume takes the newest usable step of either tier (memory first at equal
steps). The tier is a cache: a failed save is logged, a step that does not load is passed over,
and with nothing durable left the run starts from scratch. Its first save of a run discards
newer memory steps (an abandoned timeline); ``close`` clears it, a failed run leaves it for its
restart. docs/elastic.md, "A memory tier", has the whole story.

[Note: the memory tier on several machines]
Resume compares the ranks' machines (host name and boot id, or ``$FTSDP_NODE``). On several,
no root is seen by every rank: saves go through ``storage.saving.save_on_nodes(..., node=<this machine>)`` (each
machine keeps its own root and a replica of the previous machine's: [Note: node-local roots] in
storage/saving/_nodes.py), and resume offers the one step ``storage.saving.restore_on_nodes`` makes
whole on every machine. Over a subgroup of such a job the tier is off (storage's own group
spans the job). A manager that saves without resuming first treats the ranks as on one machine.

[Note: whose memory tier]
A start may find another run's steps (a job killed before ``close``, then started over on a
re-created root). One of the same model would load, silently continuing the deleted run; so
each memory save records the newest durable step committed when it was taken
(``memory_tier.durable_step``, -1 before the first), and resume passes over a memory step that
followed a durable step later than every step under the checkpoint root.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import torch.distributed as dist

from ftsdp import storage
from ftsdp.checkpoint._durable import DurableTier
from ftsdp.checkpoint._tier import Tier

NODE_ENV = "FTSDP_NODE"  # overrides _machine(): e.g. to simulate several nodes on one machine
_DURABLE_STEP = "memory_tier.durable_step"


def _machine() -> str:
    """This machine as far as shared memory goes: host name and boot id, or ``$FTSDP_NODE``."""
    if os.environ.get(NODE_ENV):
        return os.environ[NODE_ENV]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _place(url: str) -> str:
    """Where a root is: a local path (plain or ``file://``) resolved, a URL as written."""
    path = url[len("file://") :] if url.startswith("file://") else url
    if "://" in path:
        return url.rstrip("/")
    return os.path.realpath(path)


class MemoryTier(Tier):
    """Saves to host shared memory beside ``durable``; a cache (see [Note: the memory tier])."""

    cache = True
    name = "the memory tier"

    def __init__(
        self, url: str, durable: DurableTier, *, options: storage.SaveOptions | None, **kw: Any
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

    def values(self) -> dict[str, Any]:
        base = self.durable.newest_committed()
        return {"memory_tier": {"durable_step": -1 if base is None else base}}

    def save(self, state: dict[str, Any], step: int, node: str | None = None, **kw: Any) -> None:
        """See :meth:`Tier.save`; always asynchronous, to this machine's root on several."""
        super().save(state, step, node=self.node, async_save=True, **kw)

    def foreign(self, step: int, values: dict[str, Any], durable: list[int]) -> str | None:
        """See [Note: whose memory tier]."""
        base = values.get(_DURABLE_STEP)
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
        """Decides how the tier is shared (collective: see [Note: the memory tier on several
        machines]); then the committed steps, or on several machines the one step made whole
        on every machine."""
        if not self.on or not self._shared():
            return []
        if self.node is None:
            return super().steps()
        restored = storage.saving.restore_on_nodes(
            self.url, node=self.node, process_group=self.group.pg
        )
        return [] if restored is None else [restored]

    def _shared(self) -> bool:
        """Whether every rank sees rank 0's tier (``node`` None) or each machine its own
        (``node`` set); off (False) over a subgroup of a job on several machines."""
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
            self.on = False
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
        try:
            if self.node is not None:  # one rank per machine clears its own
                storage.saving.clear_on_nodes(self.url, node=self.node, process_group=self.group.pg)
            elif rank == 0:
                storage.catalog.clear_steps(self.url)
        except OSError as e:
            self.log(f"ftsdp: clearing the memory tier {self.url} failed: {e}")
        self.on = False
