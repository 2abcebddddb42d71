"""One unit: its FlatParameter, this rank's shard, the original-parameter views; SHARDED ->
(GATHERING) -> UNSHARDED and back, both idempotent (docs/engine.md, "The unit lifecycle"). Building
a model's units: device, process groups, a meta model materialised unit by unit (docs/engine.md)."""

from __future__ import annotations

import itertools
import logging
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ._collectives import (
    CommStats,
    all_gather_flat,
    all_gather_objects,
    all_gather_rows,
    all_reduce_flat,
    broadcast_flat,
    group_rank,
    group_size,
    reduce_scatter_flat,
)
from ._common import Groups, ShardingStrategy, UnitState
from ._streams import HostSchedule, Waitable
from ._wrap import UnitPlan

if TYPE_CHECKING:
    from typing import TypeAlias

    from torch.distributed.device_mesh import DeviceMesh

    # process_group=: one group, or (shard group, replicate group) for HYBRID_SHARD
    ProcessGroups: TypeAlias = dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup]

logger = logging.getLogger(__name__)


STALE_ATTR = "_ftsdp_stale"  # set on original parameters once their values moved into a shard
SHARDED_ATTR = "_ftsdp_sharded"  # set on the 1-D local-slice parameters the optimizer sees


@dataclass
class MemoryGauge:
    """Bytes of full (unsharded) buffers allocated now across a model's units, and the peak."""

    now: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


@dataclass(frozen=True, kw_only=True)
class UnitOptions:
    """What every unit of one wrapped model shares."""

    device: torch.device  # where compute (and the unsharded parameters) happen
    param_dtype: torch.dtype | None = None  # None: the parameters' own dtype
    reduce_dtype: torch.dtype | None = None  # None: param_dtype
    offload: bool = False  # shards and sharded gradients live on the host
    deterministic: bool = False
    sync_module_states: bool = False


@dataclass
class ParamInfo:
    """Where one original parameter sits in its unit's FlatParameter and in this rank's shard."""

    fqn: str
    refs: list[tuple[nn.Module, str]]
    shape: torch.Size
    offset: int  # first element in the (unpadded) flat parameter
    numel: int
    requires_grad: bool
    # This rank's slice: elements [param_start, +length) of the flattened parameter, stored
    # at [shard_start, +length) of the shard.
    param_start: int = 0
    shard_start: int = 0
    length: int = 0
    chunk: int = 0  # the unit's shard size when sharded, else 0 (ShardView.layout)
    sharded_param: nn.Parameter = field(init=False, repr=False)  # the slice the optimizer sees


class FlatParamUnit:
    """The FlatParameter of one unit and everything it needs to shard, gather and reduce."""

    def __init__(
        self,
        plan: UnitPlan,
        options: UnitOptions,
        groups: Groups,
        stats: CommStats,
        gauge: MemoryGauge,
        schedule: HostSchedule,
    ) -> None:
        self.module = plan.module
        self.gauge = gauge
        self.schedule = schedule  # see [Note: streams]
        self.fqn = plan.fqn
        self.options = options
        self.deterministic = options.deterministic
        self.device = options.device
        self.shard_device = torch.device("cpu") if options.offload else options.device
        self.shard_group = groups.shard
        self.replicate_group = groups.replicate
        self.stats = stats
        self.factor = group_size(groups.shard)  # F: how many ranks split this FlatParameter
        self.rank = group_rank(groups.shard)
        self.data_parallel_size = self.factor * group_size(groups.replicate)
        self.state = UnitState.SHARDED

        params = [pp.param for pp in plan.params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{pp.fqn}: {pp.param.dtype}" for pp in plan.params)
            raise ValueError(
                f"unit {self.fqn or '<root>'!r} mixes parameter dtypes ({listing}); a "
                "FlatParameter has one dtype: cast the module first, or wrap the differing "
                "submodules as their own units"
            )
        self.dtype = dtypes.pop() if dtypes else torch.float32  # the master (shard) dtype
        self.param_dtype = options.param_dtype or self.dtype  # unsharded params, all-gather
        self.reduce_dtype = options.reduce_dtype or self.param_dtype
        offsets = itertools.accumulate((p.numel() for p in params), initial=0)
        self.infos = [
            ParamInfo(pp.fqn, pp.refs, p.shape, offset, p.numel(), p.requires_grad)
            for pp, p, offset in zip(plan.params, params, offsets, strict=False)
        ]
        self.numel = sum(p.numel() for p in params)
        # right-padded to F equal shards: one flat collective per unit (docs/engine.md)
        self.shard_numel = math.ceil(self.numel / self.factor) if self.numel else 0
        self.padded_numel = self.shard_numel * self.factor

        self.shard = self._build_shard(params, groups.world)
        self._make_local_params(params)
        self._make_full_buffer()
        # the flat gradient the .grad are views of, held weakly: zero_grad(None) frees it
        self._sharded_grad_ref: weakref.ref | None = None
        self._unsharded_grad: torch.Tensor | None = None  # 1-D [padded_numel] (no_sync)
        self._contributions: list[torch.Tensor] = []  # deterministic mode: one per backward
        self._padding = 0  # of those, padding passes' (zeros; not counted in the mean)
        self.real_rows = 0  # every rank's non-padding contributions: the deterministic divisor
        self._sender_order: list[int] | None = None  # see _senders
        self.used = [False] * len(self.infos)  # which parameters got a gradient
        self._gathered_version = -1  # the shard's version when it was last all-gathered
        self._gather_token: object = None  # the all-gather in flight (see [Note: streams])
        # (token, output, second stage needed, keep-alive): reductions not yet accumulated
        self._pending: list[tuple[object, torch.Tensor, bool, object]] = []
        self._reduced: list[torch.Tensor] = []  # completed sharded gradients, not yet added

    def _build_shard(
        self, params: list[nn.Parameter], broadcast_group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)  # 1-D
        with torch.no_grad():
            for info, p in zip(self.infos, params, strict=True):
                flat[info.offset : info.offset + info.numel].copy_(p.reshape(-1))
        if self.options.sync_module_states and self.numel:
            broadcast_flat(flat, broadcast_group, stats=self.stats)
        start = self.rank * self.shard_numel
        shard = flat if self.factor == 1 else flat[start : start + self.shard_numel].clone()
        if not self.options.offload:
            return shard
        shard = shard.to(self.shard_device)  # CPU offload: the master shard lives on the host
        return shard.pin_memory() if torch.cuda.is_available() else shard

    def _make_local_params(self, params: list[nn.Parameter]) -> None:
        """Give each original parameter its 1-D local slice; retire the original tensor."""
        shard_lo = self.rank * self.shard_numel
        shard_hi = shard_lo + self.shard_numel
        for info, original in zip(self.infos, params, strict=True):
            lo = min(max(info.offset, shard_lo), shard_hi)
            hi = max(min(info.offset + info.numel, shard_hi), lo)
            info.param_start = lo - info.offset if hi > lo else 0
            info.shard_start = lo - shard_lo
            info.length = hi - lo
            info.chunk = self.shard_numel if self.factor > 1 else 0
            local = nn.Parameter(
                self.shard[info.shard_start : info.shard_start + info.length],
                requires_grad=info.requires_grad,
            )
            setattr(local, SHARDED_ATTR, True)
            info.sharded_param = local
            for module, name in info.refs:
                module._parameters[name] = local
            # The original tensor's values now live in the shards; drop its storage so every
            # rank really holds 1/F of the unit, and mark it so a stale optimizer is caught.
            original.data = torch.empty(0, dtype=original.dtype, device=original.device)
            setattr(original, STALE_ATTR, True)

    def _make_full_buffer(self) -> None:
        # The leaf has its own version counter: refilling _full must not trip autograd's
        # checks on the views it saved (docs/engine.md, "The unit lifecycle").
        if self.aliases_shard:
            self._full = self.shard  # the shard is the whole (padded) flat parameter
        else:
            self._full = torch.empty(self.padded_numel, dtype=self.param_dtype, device=self.device)
        full = self._full
        self.leaf = torch.empty(0, dtype=self.param_dtype, device=self.device).set_(
            full.untyped_storage(), full.storage_offset(), full.shape, full.stride()
        )
        self._split_sizes = [info.numel for info in self.infos] + [self.padded_numel - self.numel]
        if self.infos:
            self.leaf.requires_grad_(True)  # toggled per forward; see expose_unsharded()
        if not self.aliases_shard:
            self._full.untyped_storage().resize_(0)

    @property
    def aliases_shard(self) -> bool:
        """The shard is the full parameter (F = 1, no mixed precision, no offload)."""
        return (
            self.factor == 1 and self.param_dtype == self.dtype and self.shard_device == self.device
        )

    @property
    def trainable(self) -> list[ParamInfo]:
        """Parameters that train now (``requires_grad`` may change after wrapping)."""
        return [info for info in self.infos if info.sharded_param.requires_grad]

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """The flat sharded gradient, while any parameter's ``.grad`` still refers to it."""
        return None if self._sharded_grad_ref is None else self._sharded_grad_ref()

    @property
    def full_bytes(self) -> int:
        """Bytes of the full (padded, ``param_dtype``) buffer while it is allocated."""
        return self._full.nbytes

    def start_unshard(self) -> None:
        """SHARDED -> GATHERING: start the all-gather (in ``param_dtype``)."""
        if self.state is not UnitState.SHARDED:
            return
        if self.aliases_shard:
            self.state = UnitState.UNSHARDED
            return

        def issue() -> Waitable | None:
            # allocated inside the schedule: on CUDA the gather stream owns it ([Note: streams])
            self._full.untyped_storage().resize_(self.full_bytes)
            with torch.no_grad():
                source = self.on_device(self.shard, count=True).to(self.param_dtype)
                return all_gather_flat(
                    self._full,
                    source,
                    self.shard_group,
                    async_op=True,
                    stats=self.stats,
                    tag=self.fqn,
                )

        # named for profiles, instead of the autograd node whose hook ran this
        with torch.profiler.record_function(f"ftsdp::all_gather {self.fqn or '<root>'}"):
            token = self.schedule.gather(issue)
        self.gauge.add(self.full_bytes)
        # The cast/copied shard need not outlive the call: gloo's work holds its inputs, NCCL
        # records their streams, and on the gather stream a block is reused in stream order.
        self._gather_token = token
        self._gathered_version = self.shard._version
        self.state = UnitState.GATHERING

    def unshard(self) -> None:
        """-> UNSHARDED: the full parameter is ready (waits for a prefetched all-gather)."""
        if self.state is UnitState.SHARDED:
            self.start_unshard()
        if self.state is UnitState.GATHERING:
            token, self._gather_token = self._gather_token, None
            self.schedule.wait(token)
            self.state = UnitState.UNSHARDED

    def is_stale(self) -> bool:
        """Gathered, but the shard changed since (an optimizer step without a backward)."""
        return (
            not self.aliases_shard
            and self.state is not UnitState.SHARDED
            and self.shard._version != self._gathered_version
        )

    def on_device(self, host: torch.Tensor, count: bool = False) -> torch.Tensor:
        """``host`` on the compute device (under offload a copy, counted if ``count``)."""
        if not self.options.offload:
            return host
        if count:
            self.stats.copies["h2d"] += host.nbytes
        return host.to(self.device, non_blocking=True, copy=True)

    def expose_unsharded(self) -> None:
        """Point every module at full-shape views of the unsharded parameter."""
        assert self.state is UnitState.UNSHARDED, self.fqn
        if not self.infos:
            return
        trains = [info.sharded_param.requires_grad for info in self.infos]
        self.leaf.requires_grad_(any(trains))
        chunks = torch.split(self.leaf, self._split_sizes)  # one split: one gradient node
        for i, (info, chunk, train) in enumerate(zip(self.infos, chunks, trains, strict=False)):
            view = chunk.view(info.shape)
            if not train:
                view = view.detach()
            elif view.requires_grad:
                view.register_hook(partial(self._mark_used, i))
            for module, name in info.refs:
                # a plain view in the Parameter slot, so autograd reaches the flat leaf
                module._parameters[name] = view  # type: ignore[assignment]

    def _mark_used(self, index: int, grad: torch.Tensor) -> None:
        self.used[index] = True

    def reshard(self) -> None:
        """UNSHARDED -> SHARDED: free the full buffer; modules see their 1-D local slices."""
        if self.state is UnitState.SHARDED:
            return
        self.unshard()  # never free a buffer an all-gather is still writing
        for info in self.infos:
            for module, name in info.refs:
                module._parameters[name] = info.sharded_param
        if not self.aliases_shard:
            self._full.untyped_storage().resize_(0)
            self.gauge.add(-self.full_bytes)
            self.schedule.freed()
        self.state = UnitState.SHARDED

    def add_unsharded_grad(self, grad: torch.Tensor, padding: bool = False) -> None:
        """Keep one backward's flat gradient until reduced (a padding pass's as zeros)."""
        if padding:
            grad.zero_()  # exact zeros: adding them changes no sum, whatever the loss was
        if self.deterministic:
            self._contributions.append(grad)
            self._padding += padding
        elif self._unsharded_grad is None:
            self._unsharded_grad = grad
        else:  # a sum of several backwards (no_sync) is kept in reduce_dtype, as FSDP2 does
            if self._unsharded_grad.dtype != self.reduce_dtype:
                self._unsharded_grad = self._unsharded_grad.to(self.reduce_dtype)
            self._unsharded_grad += grad

    def has_unreduced_grad(self) -> bool:
        return self._unsharded_grad is not None or bool(self._contributions)

    def contribution_counts(self) -> tuple[int, int]:
        """(contributions kept, of which padding) for deterministic mode's agreement."""
        return len(self._contributions), self._padding

    def drop_unreduced_grad(self) -> None:
        """Forget gradients not yet added to the sharded gradient (``model.zero_grad()``)."""
        self._unsharded_grad = None
        self._reduced.clear()
        self._contributions.clear()
        self._padding = 0
        self.used = [False] * len(self.infos)

    def reduce_grad(self) -> None:
        """Start reducing the kept flat gradient in ``reduce_dtype``."""
        if self.deterministic:
            self._reduce_deterministic()
            return
        grad, self._unsharded_grad = self._unsharded_grad, None
        assert grad is not None, self.fqn
        out: torch.Tensor | None = None
        cast: torch.Tensor | None = None

        def issue() -> Waitable | None:
            nonlocal out, cast
            cast = grad.to(self.reduce_dtype)
            if self.factor > 1:
                out = torch.empty(self.shard_numel, dtype=cast.dtype, device=cast.device)
                return reduce_scatter_flat(
                    out,
                    cast,
                    self.shard_group,
                    async_op=True,
                    stats=self.stats,
                    tag=self.fqn,
                    consume_input=True,  # the flat gradient is dropped once reduced
                )
            out = cast
            return all_reduce_flat(
                out, self.replicate_group, async_op=True, stats=self.stats, tag=self.fqn
            )

        with torch.profiler.record_function(f"ftsdp::reduce {self.fqn or '<root>'}"):
            token = self.schedule.reduce(issue)
        assert out is not None, self.fqn  # issue() ran inside reduce()
        second_stage = self.factor > 1 and self.replicate_group is not None
        # The gradient stays referenced until the reduction is waited for (see [Note: streams]).
        self._pending.append((token, out, second_stage, (grad, cast)))

    def _reduce_deterministic(self) -> None:
        """The mean of every rank's gradients in (rank, order) sequence (docs/engine.md)."""
        mine = torch.stack(self._contributions)  # [k, padded_numel]
        groups = [g for g in (self.shard_group, self.replicate_group) if g is not None]
        self._contributions.clear()
        self._padding = 0
        rows = all_gather_rows(mine, groups, stats=self.stats)  # [W*k, padded]
        k = mine.shape[0]
        # summed in global rank order whatever the layout of the two groups
        order = [b * k + j for b in self._senders(groups, rows.shape[0] // k) for j in range(k)]
        total = rows[order[0]].to(self.dtype, copy=True)
        for i in order[1:]:
            total += rows[i]
        total /= max(1, self.real_rows)
        start = self.rank * self.shard_numel
        out = total[start : start + self.shard_numel].clone()
        self._pending.append((None, out, False, mine))

    def _senders(self, groups: list[dist.ProcessGroup], world: int) -> list[int]:
        """The blocks of ``all_gather_rows``' result in the global rank order of their senders
        (learned once, by gathering the ranks the same way): a HYBRID layout whose shard
        groups are not runs of consecutive ranks gathers them in another order."""
        if self._sender_order is None:
            if len(groups) < 2 or world == 1:
                self._sender_order = list(range(world))
            else:
                me = torch.tensor([[dist.get_rank()]], dtype=torch.int64, device=self.device)
                ranks = all_gather_rows(me, groups, stats=self.stats).reshape(-1).tolist()
                self._sender_order = sorted(range(world), key=ranks.__getitem__)
        return self._sender_order

    def complete_reductions(self) -> None:
        """Wait for the reductions in flight and keep their sharded results."""
        for token, out, second_stage, _keepalive in self._pending:
            self.schedule.wait(token)
            if second_stage:
                all_reduce_flat(out, self.replicate_group, stats=self.stats, tag=self.fqn)
            out = out.to(self.dtype)  # fp32 gradients for the fp32 master shards
            if not self.deterministic:  # deterministic reductions are averaged already
                out.div_(self.data_parallel_size)
            if self.options.offload:  # device -> host, not blocking: see [Note: streams]
                self.stats.copies["d2h"] += out.nbytes
                host = torch.empty(
                    out.shape,
                    dtype=out.dtype,
                    device=self.shard_device,
                    pin_memory=torch.cuda.is_available(),
                )
                out = host.copy_(out, non_blocking=True)
            self._reduced.append(out)
        self._pending.clear()

    def finish_reduction(self, used: list[bool]) -> None:
        """Add the reduced gradients in; a parameter no rank ``used`` keeps ``grad=None``."""
        self.complete_reductions()
        for out in self._reduced:
            self._accumulate_sharded_grad(out, used)
        self._reduced.clear()
        self.used = [False] * len(self.infos)

    def _accumulate_sharded_grad(self, new: torch.Tensor, used: list[bool]) -> None:
        """Add ``new`` (1-D, shard_numel) to the gradients the optimizer sees."""
        buffer = self.sharded_grad
        trainable = [
            (i, info) for i, info in enumerate(self.infos) if info.sharded_param.requires_grad
        ]
        if buffer is not None and all(
            info.sharded_param.grad is not None and info.sharded_param.grad._base is buffer
            for _, info in trainable
        ):
            buffer += new
            return
        # Some gradients were cleared (zero_grad(set_to_none=True)) or replaced: start from
        # what the parameters hold now, then point them at views of one flat buffer.
        with torch.no_grad():
            for _, info in trainable:
                held = info.sharded_param.grad
                if held is not None:
                    new[info.shard_start : info.shard_start + info.length] += held.reshape(-1)
        self._sharded_grad_ref = weakref.ref(new)
        for i, info in trainable:
            if used[i] or info.sharded_param.grad is not None:
                info.sharded_param.grad = new[info.shard_start : info.shard_start + info.length]


def resolve_groups(
    strategy: ShardingStrategy, process_group: ProcessGroups | None, device_mesh: DeviceMesh | None
) -> Groups:
    """Shard / replicate / world groups from ``process_group`` or a ``DeviceMesh``."""
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group= or device_mesh=, not both")
        if device_mesh.ndim == 2:
            if strategy is not ShardingStrategy.HYBRID_SHARD:
                raise ValueError(
                    f"a 2-D device_mesh means HYBRID_SHARD (replicate x shard); got "
                    f"sharding_strategy={strategy.name}"
                )
            return Groups(device_mesh.get_group(1), device_mesh.get_group(0), dist.group.WORLD)
        if device_mesh.ndim != 1:
            raise ValueError(f"device_mesh must be 1-D or 2-D, got {device_mesh.ndim}-D")
        process_group = device_mesh.get_group()
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if isinstance(process_group, tuple):
            if len(process_group) != 2 or not all(
                isinstance(g, dist.ProcessGroup) for g in process_group
            ):
                raise ValueError("HYBRID_SHARD takes process_group=(shard_group, replicate_group)")
            return Groups(process_group[0], process_group[1], dist.group.WORLD)
        if process_group is not None:
            raise ValueError(
                "HYBRID_SHARD needs a 2-D device_mesh=, a (shard_group, replicate_group) "
                "tuple, or nothing (shard within each node of LOCAL_WORLD_SIZE ranks)"
            )
        return _node_groups()
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            f"process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__}"
        )
    if process_group is None and dist.is_initialized():
        process_group = dist.group.WORLD
    if strategy is ShardingStrategy.NO_SHARD:
        return Groups(None, process_group, process_group)
    return Groups(process_group, None, process_group)


def _node_groups() -> Groups:
    """HYBRID_SHARD's default: shard inside each node, replicate across nodes."""
    if not dist.is_initialized():
        raise ValueError("HYBRID_SHARD needs torch.distributed to be initialised")
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ValueError(f"HYBRID_SHARD: world size {world} is not a multiple of {local=}")
    shard = replicate = None
    for start in range(0, world, local):  # every rank creates every group, in order
        group = dist.new_group(list(range(start, start + local)))
        if start <= rank < start + local:
            shard = group
    for offset in range(local):
        group = dist.new_group(list(range(offset, world, local)))
        if rank % local == offset:
            replicate = group
    return Groups(shard, replicate, dist.group.WORLD)


def resolve_device(module: nn.Module, device_id: int | torch.device | None) -> torch.device:
    """The device the shards and compute live on."""
    if device_id is None:
        devices = {p.device for p in module.parameters() if not p.is_meta}
        if len(devices) > 1:
            raise ValueError(
                f"the module's parameters are on several devices {sorted(map(str, devices))}; "
                "pass device_id= or move the module to one device first"
            )
        return devices.pop() if devices else torch.device("cpu")
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else device_id
    if not isinstance(device, torch.device):
        raise ValueError(f"device_id must be an int or a torch.device, got {device_id!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device_id={device_id!r} names a CUDA device, but CUDA is not available")
    return device


def check_same_structure(plans: list[UnitPlan], group: dist.ProcessGroup | None) -> None:
    """Refuse a model that differs across ranks (it would hang a collective later)."""
    if group_size(group) == 1:
        return
    mine = [
        (
            sum(pp.param.numel() for pp in plan.params),
            sum(pp.param.numel() for pp in plan.params if pp.param.requires_grad),
            sorted({str(pp.param.dtype) for pp in plan.params}),
        )
        for plan in plans
    ]
    everyone = all_gather_objects(mine, group)
    if differing := [r for r, row in enumerate(everyone) if row != everyone[0]]:
        raise ValueError(
            "the wrapped model differs across ranks (per unit: parameter count, trainable "
            f"count, dtypes): rank 0 has {everyone[0]}, "
            + ", ".join(f"rank {r} has {everyone[r]}" for r in differing)
            + "; build the same model on every rank before wrapping"
        )


def build_units(
    module: nn.Module,
    plans: list[UnitPlan],
    options: UnitOptions,
    groups: Groups,
    stats: CommStats,
    param_init_fn: Callable[[nn.Module], None] | None,
    gauge: MemoryGauge,
    schedule: HostSchedule,
) -> list[FlatParamUnit]:
    """One FlatParamUnit per plan; a meta-device model is materialised unit by unit."""
    # Units are built as the modules() walk passes their last module; an eager model builds
    # in the same order, so a meta-device rank and an eager one pair their broadcasts.
    unit_of = {id(pp.param): i for i, plan in enumerate(plans) for pp in plan.params}
    modules = list(module.modules())
    # per module, the units holding its parameters (an ignored parameter has none)
    owners = [
        sorted({unit_of[id(p)] for p in m._parameters.values() if id(p) in unit_of})
        for m in modules
    ]
    last_module = {u: index for index, us in enumerate(owners) for u in us}
    order = sorted(last_module, key=lambda u: (last_module[u], u))
    order += [u for u in range(len(plans)) if u not in last_module]
    units: list[FlatParamUnit | None] = [None] * len(plans)
    if any(pp.param.is_meta for plan in plans for pp in plan.params):
        materialized: set[int] = set()
        reset_done: set[int] = set()  # ids of the parameters a reset_parameters() has set
        uninitialised: list[str] = []  # modules with meta tensors that nothing initialised
        names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
        for index, m in enumerate(modules):
            for u in owners[index]:
                if u not in materialized:
                    _materialize(plans[u], options.device)
                    materialized.add(u)
            # a module holding only buffers (a rotary embedding's frequencies) is initialised
            # too, as torch FSDP does: materialized, its buffers would hold whatever memory held
            meta_buffers = any(b is not None and b.is_meta for b in m._buffers.values())
            _materialize_buffers(m, options.device)
            if owners[index] or meta_buffers:
                reset = getattr(m, "reset_parameters", None)
                if param_init_fn is not None:
                    with torch.no_grad():
                        param_init_fn(m)
                elif callable(reset):
                    _reset_keeping_shared(m, reset, reset_done)
                else:
                    uninitialised.append(f"{names.get(id(m)) or '<root>'} ({type(m).__name__})")
            for u in owners[index]:
                if last_module[u] == index:
                    units[u] = FlatParamUnit(plans[u], options, groups, stats, gauge, schedule)
        if uninitialised:
            logger.warning(
                "ftsdp.FSDP: %d module(s) built on the meta device have no reset_parameters() "
                "and no param_init_fn was given, so their parameters hold uninitialised memory "
                "and their buffers zeros until weights are loaded into them: %s%s. Pass "
                "param_init_fn=... (e.g. a Hugging Face model's _init_weights) or load a "
                "checkpoint before training",
                len(uninitialised),
                ", ".join(uninitialised[:5]),
                ", ..." if len(uninitialised) > 5 else "",
            )
    else:
        # param_init_fn only initialises meta parameters (as in torch FSDP): rank 0 may hold
        # real weights while the others build on meta and receive them by sync_module_states.
        module.to(options.device)
    for u in order:
        if units[u] is None:
            units[u] = FlatParamUnit(plans[u], options, groups, stats, gauge, schedule)
    return units  # type: ignore[return-value]


def _reset_keeping_shared(m: nn.Module, reset: Callable[[], object], reset_done: set[int]) -> None:
    """``m.reset_parameters()``; a parameter shared with a module reset earlier (a tied head)
    keeps that module's values, as in an eager build that ties after construction, while the
    reset still draws from the RNG as it would there."""
    shared = {
        name: p.detach().clone()
        for name, p in m._parameters.items()
        if p is not None and id(p) in reset_done
    }
    with torch.no_grad():
        reset()
        for name, value in shared.items():
            m._parameters[name].copy_(value)  # type: ignore[union-attr]
    reset_done.update(id(p) for p in m._parameters.values() if p is not None)


def _materialize(plan: UnitPlan, device: torch.device) -> None:
    """Allocate the plan's parameters on ``device`` (uninitialised), keeping ties."""
    for pp in plan.params:
        meta = pp.param
        real = nn.Parameter(
            torch.empty(meta.shape, dtype=meta.dtype, device=device),
            requires_grad=meta.requires_grad,
        )
        for owner, name in pp.refs:
            owner._parameters[name] = real
        setattr(meta, STALE_ATTR, True)
        pp.param = real


def _materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Meta buffers become zeros on ``device`` (``reset_parameters`` may fill them)."""
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
