"""The memory tier: a node-local cache of the newest steps in host shared memory
(docs/elastic.md, "A memory tier" and "The memory tier on several machines")."""

from __future__ import annotations

import os
import socket
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
    path = url.removeprefix("file://")
    if "://" in path:
        return url.rstrip("/")
    return os.path.realpath(path)


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

    def values(self) -> dict[str, Any]:
        base = self.durable.newest_committed()
        return {"memory_tier": {"durable_step": -1 if base is None else base}}

    def save(self, state: dict[str, Any], step: int, node: str | None = None, **kw: Any) -> None:
        """See :meth:`Tier.save`; always asynchronous, to this machine's root on several."""
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
        """Decide how the tier is shared (collective), then its committed steps (on several
        machines, the one step made whole on every machine)."""
        if not self.on or not self._shared():
            return []
        if self.node is None:
            return super().steps()
        restored = storage.saving.restore_on_nodes(
            self.url, node=self.node, process_group=self.group.pg
        )
        return [] if restored is None else [restored]

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
