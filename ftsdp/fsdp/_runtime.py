"""The hooks driving every unit (docs/engine.md): collectives in autograd order, so every rank runs
the same control flow."""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook

from ._collectives import all_gather_objects, all_reduce_flat
from ._common import Phase, ShardingStrategy, UnitState, tree_map
from ._unit import FlatParamUnit


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in nested tuples, lists, dicts and dataclasses (model inputs/outputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif not isinstance(value, (tuple, list)):
        return []
    return [t for v in value for t in _tensors_in(v)]


def _cast_float(value: Any, dtype: torch.dtype) -> Any:
    """``value`` cast to ``dtype`` if it is a floating-point tensor."""
    floating = isinstance(value, torch.Tensor) and value.is_floating_point()
    return value.to(dtype) if floating else value


# HYBRID_SHARD is FULL_SHARD inside each shard group (the paper's hybrid), so it frees too.
_FREE_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


@dataclasses.dataclass(slots=True)
class _UnitRun:
    """Per-backward bookkeeping of one unit (forward tickets: docs/engine.md)."""

    wants_grad: bool = False  # a forward under grad mode used trainable parameters
    grad_seen: bool = False  # the leaf's gradient arrived in this backward
    pending: set[int] = dataclasses.field(default_factory=set)  # inputs' gradients not in
    active: set[int] = dataclasses.field(default_factory=set)  # outputs' gradients arrived
    ticket: int | None = None  # the ticket of the forward running now


class Runtime:
    """Owns the units of one wrapped model and the hooks that drive them."""

    def __init__(
        self,
        units: list[FlatParamUnit],
        strategy: ShardingStrategy,
        group: dist.ProcessGroup | None,
        *,
        backward_prefetch: bool,
        forward_prefetch: bool,
        limit_all_gathers: bool,
        cast_root_inputs_to: torch.dtype | None,
        cast_inputs_to: torch.dtype | None,
    ) -> None:
        self.units = units
        # the paper's scheduling knobs (docs/engine.md, "Performance features")
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        # MixedPrecision's casts of floating inputs: the root's, every other unit's
        self.cast_root_inputs_to, self.cast_inputs_to = cast_root_inputs_to, cast_inputs_to
        self._gathering: deque[FlatParamUnit] = deque()  # prefetched, oldest first
        self._reducing: deque[FlatParamUnit] = deque()  # reductions in flight, oldest first
        self._forward_order: list[FlatParamUnit] = []  # this iteration's pre-forward order
        self._backward_order: list[FlatParamUnit] = []  # this iteration's pre-backward order
        self._last_forward: list[FlatParamUnit] = []
        self._last_backward: list[FlatParamUnit] = []
        self.group = group  # every data-parallel rank: agrees which parameters got gradients
        self.root = units[0]
        self.strategy = strategy
        self.phase = Phase.IDLE
        self.no_sync = False
        self.padding = False  # FSDP.padding(): this backward's gradients count as zeros
        self._callback_queued = False
        self._runs = {id(u): _UnitRun() for u in units}
        self._tickets = itertools.count()
        for unit in self.units:
            if unit is not self.root and not unit.infos:
                continue  # a unit with no parameters of its own has nothing to gather
            module = unit.module
            # Outside any torch.compile graph: the hooks run eagerly at a graph break, and the
            # module code between them compiles (docs/engine.md, "torch.compile").
            pre, post = self._pre_forward_hook(unit), self._post_forward_hook(unit)
            module.register_forward_pre_hook(torch.compiler.disable(pre), with_kwargs=True)
            module.register_forward_hook(torch.compiler.disable(post))
            if unit.infos:
                unit.leaf.register_post_accumulate_grad_hook(self._grad_hook(unit))

    def _pre_forward_hook(self, unit: FlatParamUnit) -> Callable:
        def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            # in backward, but autograd runs none on this thread (recomputation would be in one):
            if self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1:
                self._abandon_backward()  # the last backward raised before it finished
            recomputing = self.phase is Phase.BACKWARD  # activation checkpointing
            if unit is self.root and not recomputing:
                self._begin_forward()
            if not recomputing and unit not in self._forward_order:
                self._forward_order.append(unit)
            self._unshard(unit)
            if self.forward_prefetch and not recomputing:
                self._prefetch_after(unit, self._last_forward)
            unit.expose_unsharded()
            if not recomputing and torch.is_grad_enabled():
                run = self._runs[id(unit)]
                run.wants_grad = run.wants_grad or bool(unit.trainable)
                if unit is not self.root:
                    self._hook_inputs(unit, (args, kwargs))
            dtype = self.cast_root_inputs_to if unit is self.root else self.cast_inputs_to
            if dtype is not None:
                cast = partial(_cast_float, dtype=dtype)
                return tree_map(args, cast), tree_map(kwargs, cast)
            return None

        return hook

    def _begin_forward(self) -> None:
        self.phase = Phase.FORWARD
        if self._forward_order:
            self._last_forward = self._forward_order
        self._forward_order = []
        for unit in self.units:
            # gathered before an optimizer step no backward followed: old weights. Every rank
            # runs the root's forward, so the ranks' collectives stay in step.
            if unit.is_stale():
                self._unshard(unit)
                unit.reshard()

    def _abandon_backward(self) -> None:
        """A backward raised before its end: finish its collectives, drop its gradients."""
        warnings.warn(
            "ftsdp.FSDP: the previous backward did not finish (it raised); its partial "
            "gradients were discarded and every unit resharded",
            stacklevel=3,
        )
        for unit in self.units:
            unit.complete_reductions()  # collectives already issued must still complete
            unit.drop_unreduced_grad()
            unit.reshard()
        self._backward_order = []
        self._end_backward()

    def _unshard(self, unit: FlatParamUnit) -> None:
        """Make ``unit`` unsharded now (waiting for its prefetched all-gather if any)."""
        unit.unshard()
        if unit in self._gathering:
            self._gathering.remove(unit)

    def _prefetch_after(self, unit: FlatParamUnit, order: list[FlatParamUnit]) -> None:
        """Start the all-gather of the unit that follows ``unit`` in ``order``."""
        if unit not in order:
            return
        index = order.index(unit) + 1
        if index >= len(order) or order[index].state is not UnitState.SHARDED:
            return
        target = order[index]
        if self.limit_all_gathers:
            # At most two prefetches outstanding (docs/engine.md, "rate limiter").
            while len(self._gathering) >= 2:
                self._unshard(self._gathering[0])
        target.start_unshard()
        if target.state is UnitState.GATHERING:
            self._gathering.append(target)
            stats = target.stats
            stats.max_in_flight = max(stats.max_in_flight, len(self._gathering))

    def _hook_inputs(self, unit: FlatParamUnit, inputs: Any) -> None:
        run = self._runs[id(unit)]
        run.ticket = None
        needing = [t for t in _tensors_in(inputs) if t.requires_grad]
        if not needing:
            return
        ticket = run.ticket = next(self._tickets)
        run.pending.add(ticket)
        register_multi_grad_hook(
            needing, lambda grads: self._inputs_grad_done(unit, ticket), mode="all"
        )

    def _post_forward_hook(self, unit: FlatParamUnit) -> Callable:
        def hook(module: Any, args: tuple, output: Any) -> None:
            if self.phase is Phase.BACKWARD:
                return  # recomputation inside backward: reshard after backward
            if not torch.is_grad_enabled():
                unit.reshard()  # no backward will come (evaluation)
            else:
                if unit is not self.root and self.strategy in _FREE_AFTER_FORWARD:
                    unit.reshard()
                ticket = self._runs[id(unit)].ticket
                outputs = [t for t in _tensors_in(output) if t.requires_grad]
                for t in outputs:
                    self._hook_output(unit, t, ticket)
                if unit is self.root and not outputs and any(u.trainable for u in self.units):
                    warnings.warn(
                        "ftsdp.FSDP: the forward ran with gradients enabled but returned no "
                        "tensor that requires grad where ftsdp can see it (tensors inside "
                        "tuples, lists, dicts and dataclasses are found); if a backward "
                        "follows, the root's gradients are still reduced, but units are "
                        "gathered late. Return tensors in one of those containers.",
                        stacklevel=2,
                    )
            if unit is self.root:
                self.phase = Phase.IDLE

        return hook

    def _hook_output(self, unit: FlatParamUnit, t: torch.Tensor, ticket: int | None) -> None:
        # a node pre-hook, so the next unit's inputs hook runs first (docs/engine.md)
        if t.grad_fn is not None:
            t.grad_fn.register_prehook(lambda grads: self._pre_backward(unit, ticket))
        else:
            t.register_hook(lambda grad: self._pre_backward(unit, ticket))

    def _ensure_callback(self) -> None:
        if not self._callback_queued:
            self.phase = Phase.BACKWARD
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, unit: FlatParamUnit, ticket: int | None = None) -> None:
        """Before the unit's backward: unshard it, prefetch the next (before its reduce-scatter)."""
        self._ensure_callback()
        if ticket is not None:
            self._runs[id(unit)].active.add(ticket)
        first_time = unit not in self._backward_order
        if first_time:
            self._backward_order.append(unit)
        self._unshard(unit)
        if first_time and self.backward_prefetch:
            order = self._last_backward or [self.root, *reversed(self._forward_order[1:])]
            self._prefetch_after(unit, order)
        # Recomputation (activation checkpointing) reads the modules. With gradients on, so
        # the views stay connected to the FlatParameter: a reentrant checkpoint runs its own
        # backward through the recomputed ops, and its gradients must reach the unit.
        with torch.enable_grad():
            unit.expose_unsharded()

    def _grad_hook(self, unit: FlatParamUnit) -> Callable[[torch.Tensor], None]:
        def hook(leaf: torch.Tensor) -> None:
            self._ensure_callback()
            grad, leaf.grad = leaf.grad, None
            assert grad is not None, unit.fqn  # the hook runs once a gradient accumulated
            unit.add_unsharded_grad(grad, self.padding)
            if not self.no_sync and not unit.deterministic:
                unit.reduce_grad()  # deterministic reductions wait for the end of backward
                self._reducing.append(unit)
                # One reduction in flight while the next unit's backward computes: at most
                # two full-size flat gradients (reducing, being computed) are alive at once.
                while len(self._reducing) > 1:
                    self._reducing.popleft().complete_reductions()
            self._runs[id(unit)].grad_seen = True
            self._maybe_reshard_after_backward(unit)

        return hook

    def _inputs_grad_done(self, unit: FlatParamUnit, ticket: int) -> None:
        self._ensure_callback()
        self._runs[id(unit)].pending.discard(ticket)
        self._maybe_reshard_after_backward(unit)

    def _maybe_reshard_after_backward(self, unit: FlatParamUnit) -> None:
        # docs/engine.md, "The unit lifecycle"; the root waits for the end of backward
        run = self._runs[id(unit)]
        waiting = run.pending & run.active if run.active else run.pending
        if unit is self.root or waiting or (run.wants_grad and not run.grad_seen):
            return
        unit.reshard()

    def _finish_backward(self) -> None:
        """Autograd engine callback: all of backward has run."""
        try:
            if not self.no_sync:
                self._check_contribution_counts()
                for unit in self.units:  # kept under no_sync, or deterministic, or not yet hooked
                    if unit.has_unreduced_grad():
                        unit.reduce_grad()
                used = self._agree_used_parameters()
                if self.root.options.offload:  # one setting for every unit
                    for unit in self.units:
                        unit.complete_reductions()
                    self.root.schedule.synchronize()  # offloaded gradients are on the host
                for unit, mask in zip(self.units, used, strict=True):
                    unit.finish_reduction(mask)
            for unit in self.units:
                unit.reshard()
        finally:
            self._end_backward()

    def _end_backward(self) -> None:
        """Forget this backward's bookkeeping; its order becomes the next prefetch order."""
        self._gathering.clear()
        self._reducing.clear()
        if self._backward_order:
            self._last_backward = self._backward_order  # re-recorded every iteration
        self._backward_order = []
        self._runs = {id(u): _UnitRun() for u in self.units}
        self._callback_queued = False
        self.phase = Phase.IDLE

    def _agree_used_parameters(self) -> list[list[bool]]:
        """Which parameters got a gradient on any rank (one small all-reduce per step)."""
        masks = [unit.used for unit in self.units]
        flat = [flag for mask in masks for flag in mask]
        if flat and self.group is not None:
            agreed = torch.tensor(flat, dtype=torch.uint8, device=self.root.device)
            # Counted apart from gradient traffic (stats.control): a few bytes per step.
            all_reduce_flat(agreed, self.group, op=dist.ReduceOp.MAX)
            self.root.stats.control["agree_used"] += agreed.numel()
            flat = [bool(v) for v in agreed.tolist()]
        values = iter(flat)
        return [list(itertools.islice(values, len(mask))) for mask in masks]

    def _check_contribution_counts(self) -> None:
        """Deterministic mode: each unit's non-padding contributions on all ranks (its divisor)."""
        if not any(u.deterministic for u in self.units):
            return
        counts = [n for u in self.units for n in u.contribution_counts()]
        everyone = all_gather_objects(counts, self.group)
        if any(row[0::2] != everyone[0][0::2] for row in everyone):
            raise RuntimeError(
                "deterministic mode: ranks ran different numbers of backward passes this step "
                f"(per unit (passes, padding), by rank: {everyone}); every rank must run the "
                "same number of micro-batches (FSDP.padding() for a rank with fewer)"
            )
        for i, unit in enumerate(self.units):
            unit.real_rows = sum(row[2 * i] - row[2 * i + 1] for row in everyone)
