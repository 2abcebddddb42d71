"""The few collectives storage needs, on small JSON metadata (never pickled tensors)."""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import torch.distributed as dist


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group to use: the given one, the default group when initialised, else None (1 rank)."""
    if process_group is not None:
        return process_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def rank_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world_size)`` within ``group``; ``(0, 1)`` without a group."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (JSON bytes in uint8 tensors)."""
    if group is None:
        return [json.loads(json.dumps(obj))]
    device, world = _device(group), dist.get_world_size(group)
    buf = _framed_to_longest(json.dumps(obj).encode(), group, device)
    bufs = [_received(buf.numel(), device) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(raw[:n]) for n, raw in (_unframed(b.cpu()) for b in bufs)]


def broadcast_json(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0's JSON-able ``obj`` on every rank (others pass anything, e.g. None): one
    broadcast of ``_FIRST`` bytes, a second only for the rest of a longer message."""
    if group is None:
        return obj
    device, src = _device(group), dist.get_global_rank(group, 0)
    data = json.dumps(obj).encode() if dist.get_rank(group) == 0 else b""
    first = _framed(data, _FIRST, device)
    dist.broadcast(first, src=src, group=group)
    n, head = _unframed(first.cpu())
    if n <= len(head):
        return json.loads(head[:n])
    rest = _padded(data[len(head) :], n - len(head)).to(device)  # elsewhere: to receive into
    dist.broadcast(rest, src=src, group=group)
    return json.loads(head + bytes(rest.cpu().numpy()))


_LENGTH = 8  # bytes: a framed message's length, little-endian, before its bytes
_FIRST = 64 << 10  # a broadcast's first (usually only) frame


def _framed(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    """``size`` bytes on ``device``: ``len(data)``, as much of ``data`` as fits, zeros."""
    framed = len(data).to_bytes(_LENGTH, "little") + data[: size - _LENGTH]
    return _padded(framed, size).to(device)


def _unframed(buf: torch.Tensor) -> tuple[int, bytes]:
    """The length a frame announces and the bytes it holds (maybe only a first part)."""
    raw = bytes(buf.numpy())
    return int.from_bytes(raw[:_LENGTH], "little"), raw[_LENGTH:]


def _framed_to_longest(data: bytes, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """``data`` framed in as many bytes as the group's longest frame (collective)."""
    longest = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    return _framed(data, _LENGTH + int(longest.item()), device)


def _padded(data: bytes, n: int) -> torch.Tensor:
    """The first ``n`` bytes of ``data``, zero-padded, as a CPU uint8 tensor over a bytearray
    (``torch.zeros`` would wake an OpenMP team on storage's background thread)."""
    if not n:
        return torch.empty(0, dtype=torch.uint8)
    buf = bytearray(n)
    k = min(len(data), n)
    buf[:k] = memoryview(data)[:k]
    return torch.frombuffer(buf, dtype=torch.uint8)


def _received(n: int, device: torch.device) -> torch.Tensor:
    """A buffer of ``n`` bytes that a collective fills whole: nothing to zero, on its device."""
    return torch.empty(n, dtype=torch.uint8, device=device)


def gather_json(obj: Any, group: dist.ProcessGroup | None) -> list[Any] | None:
    """Every rank's JSON-able ``obj`` in rank order on group rank 0, None on the others."""
    if group is None:
        return [json.loads(json.dumps(obj))]
    device, world, me = _device(group), dist.get_world_size(group), dist.get_rank(group)
    dst = dist.get_global_rank(group, 0)
    buf = _framed_to_longest(json.dumps(obj).encode(), group, device)
    bufs = [_received(buf.numel(), device) for _ in range(world)] if me == 0 else None
    dist.gather(buf, bufs, dst=dst, group=group)
    if bufs is None:
        return None
    return [json.loads(raw[:n]) for n, raw in (_unframed(b.cpu()) for b in bufs)]


def scatter_json(objs: list[Any] | None, group: dist.ProcessGroup | None) -> Any:
    """Group rank 0 passes one JSON-able object per rank; each rank gets its own."""
    if group is None:
        assert objs is not None
        return json.loads(json.dumps(objs[0]))
    device, me, src = _device(group), dist.get_rank(group), dist.get_global_rank(group, 0)
    datas = [json.dumps(o).encode() for o in objs] if me == 0 and objs is not None else []
    head = torch.tensor([max(map(len, datas), default=0)], dtype=torch.int64, device=device)
    dist.broadcast(head, src=src, group=group)
    size = _LENGTH + int(head.item())
    bufs = [_framed(d, size, device) for d in datas] if me == 0 else None
    buf = _received(size, device)
    dist.scatter(buf, bufs, src=src, group=group)
    n, raw = _unframed(buf.cpu())
    return json.loads(raw[:n])


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The element-wise maximum over the group of ``values`` (int64)."""
    if group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.cpu().tolist()]


# Storage's own gloo groups, by (ranks, lane): a background save never shares a group with the
# training loop's collectives (docs/design.md, "The commit protocol").
_own_groups: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}
_own_lock = threading.Lock()


def own_group(group: dist.ProcessGroup | None, lane: str = "") -> dist.ProcessGroup | None:
    """Storage's own gloo group for the saves of ``lane`` (a root) over ``group`` when that is
    every rank of the job (made the first time: a collective of all ranks); None without a
    process group or for a subgroup."""
    if group is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks != tuple(range(dist.get_world_size())):
        return None
    with _own_lock:
        cached = _own_groups.get((ranks, lane))
        if cached is not None and _alive(cached):
            return cached
        made = dist.new_group(backend="gloo")
        _own_groups[(ranks, lane)] = made
        return made


def release_own_group(lane: str) -> None:
    """Destroy storage's own groups for ``lane`` (collective: after a barrier on each, so that
    no rank still uses one when another closes its connections)."""
    with _own_lock:
        groups = [_own_groups.pop(k) for k in [k for k in _own_groups if k[1] == lane]]
    for group in groups:
        if _alive(group):
            dist.barrier(group=group)
            dist.destroy_process_group(group)


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True
