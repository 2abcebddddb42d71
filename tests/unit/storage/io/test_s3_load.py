"""Loads from a real S3 server (SeaweedFS): concurrent ranged GETs, coalesced, through one
filesystem, within the in-flight budget (``LoadOptions.inflight_bytes``), and host memory bounded
by the state plus that budget, measured in a fresh process.

Every GET of a data object is watched on the wire (s3fs's ``_call_s3``): its range, and how long
its body stays open. The loaded tensors are compared with the saved ones, bitwise.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ftsdp import storage
from tests.s3_fixture import new_bucket_url

MiB = 1 << 20
BUDGET = 8 * MiB


@pytest.fixture(scope="module")
def s3(s3_endpoint: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` of the session's SeaweedFS server."""
    return s3_endpoint


@pytest.fixture(scope="module")
def bucket(s3: dict[str, Any]) -> str:
    """``s3://<bucket>``, one for this module, each test's checkpoint under a prefix of its own:
    a fresh SeaweedFS bucket costs about a second and a half before its first concurrent writes
    return (it is created, then grows its volume). One small write first grows the volume alone,
    the quicker way."""
    import s3fs

    url = new_bucket_url(s3).removesuffix("/ckpt")
    s3fs.S3FileSystem(**s3).pipe_file(f"{url.removeprefix('s3://')}/warm", b"warm")
    return url


def _root(bucket: str) -> str:
    """An empty checkpoint root of its own in the module's bucket."""
    return f"{bucket}/{uuid.uuid4().hex[:12]}/ckpt"


@pytest.fixture(scope="module")
def saved(s3: dict[str, Any], bucket: str) -> tuple[str, dict[str, torch.Tensor]]:
    """48 MB in 6 tensors, saved as objects of at most 16 MiB (step 1)."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(2_000_000, generator=g) for i in range(6)}
    url = _root(bucket)
    storage.save(
        state, url, 1, storage_options=s3, options=storage.SaveOptions(object_bytes=16 * MiB)
    )
    return url, state


class Wire:
    """GETs of data objects: ranges, the most open at once, the most bytes open at once, and
    which filesystem objects sent them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ranges: list[tuple[str, int, int]] = []
        self.filesystems: set[int] = set()
        self.open = self.open_bytes = self.most_open = self.most_bytes = 0

    def opened(self, fs: Any, key: str, lo: int, hi: int) -> None:
        with self.lock:
            self.ranges.append((key, lo, hi))
            self.filesystems.add(id(fs))
            self.open += 1
            self.open_bytes += hi - lo
            self.most_open = max(self.most_open, self.open)
            self.most_bytes = max(self.most_bytes, self.open_bytes)

    def closed(self, n: int) -> None:
        with self.lock:
            self.open -= 1
            self.open_bytes -= n


class _Body:
    """A response body that tells ``wire`` when it is closed."""

    def __init__(self, body: Any, wire: Wire, n: int) -> None:
        self.body, self.wire, self.n, self.done = body, wire, n, False

    async def read(self, amt: int | None = None) -> bytes:
        return await self.body.read(amt)

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.wire.closed(self.n)
        self.body.close()


@contextlib.contextmanager
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Wire]:
    import s3fs

    wire, original = Wire(), s3fs.S3FileSystem._call_s3

    async def call(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if method != "get_object" or not kwargs.get("Key", "").endswith(".safetensors"):
            return await original(self, method, *args, **kwargs)
        lo, hi = (int(x) for x in kwargs["Range"].removeprefix("bytes=").split("-"))
        wire.opened(self, kwargs["Key"], lo, hi + 1)
        try:
            resp = await original(self, method, *args, **kwargs)
        except BaseException:
            wire.closed(hi + 1 - lo)
            raise
        return {**resp, "Body": _Body(resp["Body"], wire, hi + 1 - lo)}

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    yield wire


@pytest.mark.timeout(120)
def test_a_load_beyond_the_budget_streams_within_it_bitwise(
    s3: dict[str, Any], saved: tuple[str, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state = saved
    target = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    options = storage.LoadOptions(inflight_bytes=BUDGET)
    with watch(monkeypatch) as wire:
        res = storage.load(target, url, storage_options=s3, options=options)
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    assert res.bytes_read == res.bytes_needed == sum(v.numel() * 4 for v in state.values())
    assert sum(hi - lo for _, lo, hi in wire.ranges) == res.bytes_read  # each byte read once
    assert wire.most_open >= 2  # concurrent GETs
    assert wire.most_bytes <= BUDGET, wire.most_bytes
    assert len(wire.filesystems) == 1  # every thread's GETs share one client and its pool


@pytest.mark.timeout(120)
def test_adjacent_ranges_are_one_get_and_a_second_load_opens_no_client(
    s3: dict[str, Any], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiobotocore.session

    state = {f"p{i}": torch.randn(65_536) for i in range(64)}  # 16 MiB, one object
    url = _root(bucket)
    storage.save(state, url, 1, storage_options=s3)
    clients = []
    create = aiobotocore.session.AioSession.create_client
    monkeypatch.setattr(
        aiobotocore.session.AioSession,
        "create_client",
        lambda self, *a, **kw: clients.append(1) or create(self, *a, **kw),
    )
    for _ in range(2):
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        with watch(monkeypatch) as wire:
            storage.load(target, url, storage_options=s3)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        assert len(wire.ranges) == 1, wire.ranges  # 64 tensors side by side: one GET
    assert clients == []  # the filesystem of the save served both loads: no new client


@pytest.mark.timeout(120)
def test_a_resharded_streamed_load_reads_only_the_ranges_it_needs(
    s3: dict[str, Any], saved: tuple[str, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, state = saved
    options = storage.LoadOptions(inflight_bytes=BUDGET)
    for rank in range(3):  # what rank r of 3 holds: an uneven third of every tensor
        shards = {}
        for name, ref in state.items():
            n = ref.numel()
            lo, hi = list(itertools.pairwise([0, n // 5, n // 5 + n // 2 + 3, n]))[rank]
            shards[name] = storage.FlatShard(ref.shape, lo, torch.full((hi - lo,), float("nan")))
        with watch(monkeypatch) as wire:
            res = storage.load(shards, url, storage_options=s3, options=options)
        for name, ref in state.items():
            s = shards[name]
            assert torch.equal(s.local, ref.reshape(-1)[s.offset : s.offset + s.local.numel()])
        assert res.bytes_needed == sum(s.local.numel() * 4 for s in shards.values())
        assert sum(hi - lo for _, lo, hi in wire.ranges) == res.bytes_read
        # widened to whole checksum blocks (1 MiB): at most one more block at each end
        assert res.bytes_read <= res.bytes_needed + 2 * MiB * len(state), res
        assert wire.most_bytes <= BUDGET


_MEASURE = textwrap.dedent(
    """
    import json, os, sys, traceback, torch
    from ftsdp import storage
    from ftsdp.testing import reset_peak_rss, status_bytes

    url, options = sys.argv[1], json.loads(sys.argv[2])

    def measure(budget):
        meta = storage.catalog.inspect_checkpoint(url, storage_options=options)
        target = {t["name"]: torch.full(t["shape"], 7.0) for t in meta["tensors"]}  # touched
        small = {"t0": torch.zeros(10)}  # a first load: imports, the client, its threads
        storage.load(small, url, storage_options=options, strict=False)
        before = reset_peak_rss()  # VmHWM := VmRSS
        storage.load(target, url, storage_options=options,
                     options=storage.LoadOptions(inflight_bytes=budget))
        return {"above": status_bytes("VmHWM") - before,
                "sum": sum(float(t.double().sum()) for t in target.values())}

    # Each measurement in a fork of this process as it is now (torch and ftsdp imported, nothing
    # loaded, no thread started): a fresh process each, without importing torch again.
    for budget in map(int, sys.argv[3:]):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                print(json.dumps(measure(budget)), flush=True)
                code = 0
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
            sys.exit(f"the measurement with a budget of {budget} bytes failed")
    """
)


def _peaks_above_state(url: str, options: dict[str, Any], *budgets: int) -> list[dict[str, float]]:
    """Per budget, a load's peak resident memory above the state and the loaded values' sum."""
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, url, json.dumps(options), *map(str, budgets)],
        capture_output=True,
        text=True,
        timeout=150,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()[-len(budgets) :]]


@pytest.mark.timeout(300)
def test_host_memory_is_the_state_plus_the_budget(
    s3: dict[str, Any], saved: tuple[str, dict[str, torch.Tensor]]
) -> None:
    """A fresh process loads the 48 MB state, 6 times the budget: its peak resident memory above
    the loaded state stays within the budget (plus the allocator's slack); held whole (a budget
    above the state), the same load's peak is the state's size again (the measure sees it)."""
    url, state = saved
    nbytes = sum(v.numel() * 4 for v in state.values())
    want = sum(float(v.double().sum()) for v in state.values())
    streamed, held = _peaks_above_state(url, s3, BUDGET, 2 * nbytes)
    assert streamed["sum"] == held["sum"] == want
    assert streamed["above"] <= BUDGET + 8 * MiB, (streamed, nbytes)
    assert held["above"] >= 0.9 * nbytes, (held, nbytes)


@pytest.mark.timeout(120)
def test_a_flipped_byte_fails_the_load_held_untouched_or_streamed(
    s3: dict[str, Any], bucket: str
) -> None:
    """A corrupt block fails either kind of load; only a load within the budget (held until
    everything is verified) promises an untouched target."""
    import s3fs

    state = {f"t{i}": torch.randn(1_000_000) for i in range(4)}  # 16 MB, one object
    url = _root(bucket)
    storage.save(state, url, 1, storage_options=s3)
    fs = s3fs.S3FileSystem(**s3)
    (obj,) = [p for p in fs.find(url.removeprefix("s3://")) if p.endswith(".safetensors")]
    data = bytearray(fs.cat(obj))
    data[-100] ^= 0x01  # in the last tensor's last block
    fs.pipe(obj, bytes(data))
    for budget in (64 * MiB, 2 * MiB):
        target = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
        with pytest.raises(storage.CorruptCheckpointError, match="checksum mismatch"):
            storage.load(
                target, url, storage_options=s3, options=storage.LoadOptions(inflight_bytes=budget)
            )
        if budget > 16 * MiB:
            assert all(torch.isnan(t).all() for t in target.values())
