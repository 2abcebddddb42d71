"""The S3 requests of a save and a load at world size 2, on a real server (SeaweedFS), counted in
each rank at aiobotocore's ``_make_api_call`` (tests/unit/storage/io/test_s3.py counts
world size 1). Rank 0 plans, collects the done markers and commits; rank 1 writes its marker
and waits for the manifest. Both poll the step's directory while they wait (one listing a
poll), so those listings depend on timing and are counted apart; everything else must not grow
from the 2nd save to the 10th with retention on."""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import torch

from ftsdp.testing import run_ranks
from tests.s3_fixture import new_bucket_url

SAVES = 10


def _rank(rank: int, world: int, url: str, opts: dict) -> dict[str, Any]:
    from aiobotocore.client import AioBaseClient

    from ftsdp import storage

    seen: list[tuple[str, str]] = []
    real = AioBaseClient._make_api_call

    async def record(self: Any, operation: str, params: dict) -> Any:
        deleted = params.get("Delete", {}).get("Objects") or [{}]
        seen.append(
            (operation, params.get("Key") or params.get("Prefix") or deleted[0].get("Key", ""))
        )
        return await real(self, operation, params)

    AioBaseClient._make_api_call = record  # this rank's process only
    state = {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(10)}
    options = storage.SaveOptions(keep_last=2, keep_every=3, object_bytes=8192)
    saves, loads = [], []
    for step in range(1, SAVES + 1):
        seen.clear()
        storage.save(state, url, step=step, storage_options=opts, options=options)
        saves.append(list(seen))
        if step in (2, SAVES):
            seen.clear()
            target = {"w": torch.zeros(64, 64), "b": torch.zeros(10)}
            storage.load(target, url, storage_options=opts)
            assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
            loads.append(list(seen))
    return {"saves": saves, "loads": loads}


def _kept(step: int) -> set[int]:
    """The steps kept after saving ``step`` (keep_last=2, keep_every=3)."""
    return {s for s in range(1, step + 1) if s % 3 == 0 or s > step - 2}


def _tally(calls: list[tuple[str, str]], step: int) -> tuple[int, int, collections.Counter]:
    """``(data requests, listings of the step's own directory, the rest by operation)``; the
    rest are named ``own:``, ``retired:`` (a step this save retired) or ``root:`` by where they
    went, and a request on a kept step fails the test."""
    retired = _kept(step - 1) - _kept(step)
    data, polls, rest = 0, 0, collections.Counter()
    for op, key in calls:
        m = re.search(r"step-(\d+)/", key)
        where = "root" if m is None else int(m.group(1))
        if where == step and key.endswith(".safetensors"):
            data += 1
        elif where == step and op == "ListObjectsV2" and key.endswith("/"):
            polls += 1
        elif where == step:
            rest[f"own:{op}"] += 1
        elif where in retired:
            rest[f"retired:{op}"] += 1
        else:
            assert where == "root", (step, op, key)  # nothing on a kept step
            rest[f"root:{op}"] += 1
    return data, polls, rest


@pytest.mark.timeout(300)
def test_two_ranks_requests_per_save_stay_constant(s3_endpoint) -> None:
    url = new_bucket_url(s3_endpoint)
    ranks = run_ranks(_rank, 2, url, dict(s3_endpoint), timeout=240, start_method="forkserver")
    for rank, got in enumerate(ranks):
        tallies = [_tally(calls, step) for step, calls in enumerate(got["saves"], start=1)]
        data = [t[0] for t in tallies]
        assert len(set(data[1:])) == 1 and data[1] >= 1, (rank, data)
        assert all(t[1] >= 1 for t in tallies), (rank, tallies)  # it polled
        rests = [t[2] for t in tallies]
        # Saves that retire a step and saves that do not: each kind costs the same throughout.
        kinds = {tuple(sorted(r.items())) for r in rests[1:]}
        assert len(kinds) <= 2, (rank, rests)
        counts = [collections.Counter(op for op, _ in calls) for calls in got["loads"]]
        assert counts[0] == counts[1], (rank, counts)
        print(f"rank {rank}: data {data}, polls {[t[1] for t in tallies]}, rest {rests[-1]}")
        print(f"rank {rank}: load {counts[-1]}")
