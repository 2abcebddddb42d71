"""The engine's collectives over flat 1-D tensors (a group of ``None`` is one rank; bytes: the ring
cost per rank, docs/engine.md "Accounting"), and the grad scaler whose ranks agree on skipping."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the flat collectives; older releases only have the *_into_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Collective calls and per-rank bytes by kind; ``copies`` (CPU offload) and ``control``
    (bookkeeping) apart; ``max_in_flight``: the most prefetched all-gathers outstanding."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    copies: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    control: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    max_in_flight: int = 0
    trace: list[str] | None = None  # set to [] to record the order of collectives

    def record(self, kind: str, nbytes: int, tag: str = "") -> None:
        self.calls[kind] += 1
        self.bytes[kind] += int(nbytes)
        if self.trace is not None:
            self.trace.append(f"{kind}:{tag}" if tag else kind)

    def reset(self) -> None:
        """Start counting over (``trace`` is kept)."""
        for counts in (self.calls, self.bytes, self.copies, self.control):
            counts.clear()
        self.max_in_flight = 0

    def total_bytes(self) -> int:
        """Collective bytes (copies excluded)."""
        return sum(self.bytes.values())


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` (no group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``; 0 for ``None`` (no group)."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_flat(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
    stats: CommStats | None = None,
    tag: str = "",
) -> dist.Work | _Works | None:
    """Gather equal 1-D shards from every rank into ``output`` (``W * shard.numel()``)."""
    world = group_size(group)
    assert output.numel() == world * shard.numel(), (output.numel(), world, shard.numel())
    if group is None or world == 1:
        output.copy_(shard)
        return None
    if stats is not None:
        stats.record("all_gather", (world - 1) * shard.nbytes, tag)
    if output.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _gather_by_broadcasts(output, shard, group, world, async_op)
    return _all_gather_single(output, shard, group=group, async_op=async_op)


class _Works:
    """Several async collectives waited for as one (and what to do once they are done)."""

    def __init__(self, works: list[dist.Work], then: Callable[[], object] | None = None) -> None:
        self.works = works
        self.then = then

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
            self.then = None

    def settle(self, async_op: bool) -> _Works | None:
        """``self`` to wait for later (``async_op``), or waited for now and ``None``."""
        if not async_op:
            self.wait()
        return self if async_op else None


def _gather_by_broadcasts(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, world: int, async_op: bool
) -> _Works | None:
    """gloo's all-gather as one broadcast per rank (docs/engine.md, "Collectives on gloo")."""
    size = shard.numel()
    mine = dist.get_rank(group)
    output[mine * size : (mine + 1) * size].copy_(shard)
    works = [
        dist.broadcast(
            output[r * size : (r + 1) * size],
            src=dist.get_global_rank(group, r),
            group=group,
            async_op=True,
        )
        for r in range(world)
    ]
    return _Works(works).settle(async_op)


def reduce_scatter_flat(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    async_op: bool = False,
    stats: CommStats | None = None,
    tag: str = "",
    consume_input: bool = False,
) -> dist.Work | _Works | None:
    """Sum ``full`` (``W * output.numel()``) over ranks; rank ``r`` keeps chunk ``r``.
    ``consume_input=True``: ``full`` may be overwritten (on gloo, no full-size copy)."""
    world = group_size(group)
    assert full.numel() == world * output.numel(), (full.numel(), world, output.numel())
    if group is None or world == 1:
        output.copy_(full)
        return None
    if stats is not None:
        stats.record("reduce_scatter", (world - 1) * output.nbytes, tag)
    if consume_input and full.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _reduce_scatter_in_place(output, full, group, async_op)
    return _reduce_scatter_single(
        output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op
    )


def _reduce_scatter_in_place(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> _Works | None:
    """gloo's reduce-scatter (an all-reduce) run on the input itself, without gloo's copy."""
    size = output.numel()
    start = dist.get_rank(group) * size
    work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _Works([work], then=lambda: output.copy_(full[start : start + size])).settle(async_op)


def all_reduce_flat(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
    stats: CommStats | None = None,
    tag: str = "",
) -> dist.Work | None:
    """All-reduce ``tensor`` in place."""
    world = group_size(group)
    if world == 1:
        return None
    if stats is not None:
        stats.record("all_reduce", 2 * (world - 1) * tensor.nbytes // world, tag)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast_flat(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, *, stats: CommStats | None = None
) -> None:
    """Overwrite ``tensor`` on every rank with group rank 0's copy."""
    if group is None or group_size(group) == 1:
        return
    if stats is not None:
        stats.record("broadcast", tensor.nbytes)
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)


def all_gather_rows(
    rows: torch.Tensor, groups: list[dist.ProcessGroup], *, stats: CommStats
) -> torch.Tensor:
    """Stack every rank's ``rows`` ([k, n], same k everywhere): [W*k, n], gathered over each
    group in turn (two groups, shard then replicate: by replica, then by shard rank; rank order
    only where each shard group is a run of consecutive ranks, hence ``FlatParamUnit._senders``)."""
    for group in groups:
        world = group_size(group)
        if world == 1:
            continue
        out = torch.empty(
            (world * rows.shape[0], *rows.shape[1:]), dtype=rows.dtype, device=rows.device
        )
        stats.record("all_gather", (world - 1) * rows.nbytes)
        _all_gather_single(out, rows.contiguous(), group=group)
        rows = out
    return rows


def all_gather_objects(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; for checks, not for tensors."""
    everyone: list[Any] = [value] * group_size(group)
    if len(everyone) > 1:
        dist.all_gather_object(everyone, value, group=group)
    return everyone


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device collectives on ``group`` expect (cuda for NCCL, cpu otherwise)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# fp16 loss scaling whose found-inf flag every rank agrees on (docs/engine.md, "fp16")
class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose skip decision every rank of ``process_group`` agrees on;
    ``device`` None: CUDA where there is one, else the CPU (torch's default, ``"cuda"``, turns
    the scaler off on a machine without CUDA)."""

    def __init__(
        self,
        device: str | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device or ("cuda" if torch.cuda.is_available() else "cpu"), **kwargs)
        self._group = process_group

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The ranks that agree (the world unless given, looked up at each step)."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return self._group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # fp16 gradients are allowed: a model kept in fp16 without MixedPrecision has them.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        group = self.process_group
        if group_size(group) == 1:
            return per_device
        # One flag for the whole rank, on the device the group communicates on. A rank with
        # no gradient at all (every shard empty) still takes part, or the others would hang.
        comm = comm_device(group)
        flag = torch.zeros(1, dtype=torch.float32, device=comm)
        for value in per_device.values():
            flag = torch.maximum(flag, value.to(comm, torch.float32).reshape(1))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not per_device:
            per_device[found_inf.device] = found_inf
        for device, value in per_device.items():
            value.copy_(flag.to(device).reshape(value.shape))
        return per_device
