"""Every incarnation joins a fresh store namespace, rank 0's token (docs/elastic.md)."""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_POLL_S = 0.01


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
    """Agree on rank 0's fresh token; every rank of the group must call it."""
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
