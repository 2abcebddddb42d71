"""Hooks that drive every unit through its lifecycle during forward and backward.

One :class:`Runtime` per wrapped model. It registers, on each unit's module:

- a forward pre-hook: unshard, expose the full-shape views, and route the module's inputs
  through :class:`_InputsGradHook` so we learn when the unit's backward has finished;
- a forward hook: reshard (FULL_SHARD, except the root, which stays unsharded until its
  backward) and hook the outputs' gradients to unshard again before the unit's backward;

and on each unit's leaf a post-accumulate-grad hook that starts the gradient reduction the
moment the unit's flat gradient is final. The first backward hook queues an autograd engine
callback that runs when the whole backward is done: it waits for every reduction (so
``loss.backward()`` returns with the sharded gradients in place) and reshards every unit.

The order of collectives is the autograd order, identical on every rank as long as every rank
runs the same model on the same control flow (see FIELD.md: rank-divergent control flow hangs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

from ._common import Phase, ShardingStrategy
from ._unit import FlatParamUnit


class _InputsGradHook(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the runtime their gradients are done."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.on_backward = on_backward
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.on_backward()
        return (None, *grads)


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested tuples / lists / dicts, keeping the structure."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value


class _UnitRun:
    """Per-backward bookkeeping of one unit (reset at the end of every backward)."""

    __slots__ = ("grad_seen", "inputs_pending", "wants_grad")

    def __init__(self) -> None:
        self.wants_grad = False  # a forward under grad mode used trainable parameters
        self.grad_seen = False  # the leaf's gradient arrived in this backward
        self.inputs_pending = 0  # forwards whose inputs' gradients have not arrived yet


class Runtime:
    """Owns the units of one wrapped model and the hooks that drive them."""

    def __init__(self, units: list[FlatParamUnit], strategy: ShardingStrategy) -> None:
        self.units = units
        self.root = units[0]
        self.strategy = strategy
        self.phase = Phase.IDLE
        self.no_sync = False
        self._callback_queued = False
        self._runs = {id(u): _UnitRun() for u in units}
        self._handles: list[Any] = []

    def register_hooks(self) -> None:
        for unit in self.units:
            if unit is not self.root and not unit.infos:
                continue  # a unit with no parameters of its own has nothing to gather
            module = unit.module
            self._handles.append(
                module.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True)
            )
            self._handles.append(module.register_forward_hook(self._post_forward_hook(unit)))
            if unit.trainable:
                self._handles.append(
                    unit.leaf.register_post_accumulate_grad_hook(self._grad_hook(unit))
                )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ---------------------------------------------------------------- forward
    def _pre_forward_hook(self, unit: FlatParamUnit) -> Callable:
        def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if unit is self.root and self.phase is not Phase.BACKWARD:
                self.phase = Phase.FORWARD
            unit.unshard()
            unit.expose_unsharded()
            if not torch.is_grad_enabled():
                return args, kwargs
            run = self._runs[id(unit)]
            run.wants_grad = run.wants_grad or bool(unit.trainable)
            return self._hook_inputs(unit, args, kwargs)

        return hook

    def _hook_inputs(self, unit: FlatParamUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        needing: list[torch.Tensor] = []
        _map_tensors((args, kwargs), lambda t: needing.append(t) if t.requires_grad else None)
        if not needing or unit is self.root:
            return args, kwargs
        self._runs[id(unit)].inputs_pending += 1
        hooked = iter(_InputsGradHook.apply(lambda: self._inputs_grad_done(unit), *needing))
        return _map_tensors((args, kwargs), lambda t: next(hooked) if t.requires_grad else t)

    def _post_forward_hook(self, unit: FlatParamUnit) -> Callable:
        def hook(module: Any, args: tuple, output: Any) -> Any:
            if self.phase is Phase.BACKWARD:
                return output  # recomputation inside backward: reshard after backward
            if not torch.is_grad_enabled():
                unit.reshard()  # no backward will come (evaluation)
            else:
                if unit is not self.root and self.strategy is ShardingStrategy.FULL_SHARD:
                    unit.reshard()
                _map_tensors(output, self._output_hooker(unit))
            if unit is self.root:
                self.phase = Phase.IDLE
            return output

        return hook

    def _output_hooker(self, unit: FlatParamUnit) -> Callable[[torch.Tensor], None]:
        def register(t: torch.Tensor) -> None:
            if t.requires_grad:
                t.register_hook(lambda grad: self._pre_backward(unit))

        return register

    # ---------------------------------------------------------------- backward
    def _pre_backward(self, unit: FlatParamUnit) -> None:
        """Before the unit's backward: make sure its full parameters are there again."""
        if not self._callback_queued:
            self.phase = Phase.BACKWARD
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        unit.unshard()

    def _grad_hook(self, unit: FlatParamUnit) -> Callable[[torch.Tensor], None]:
        def hook(leaf: torch.Tensor) -> None:
            grad, leaf.grad = leaf.grad, None
            unit.add_unsharded_grad(grad)
            if not self.no_sync:
                unit.reduce_grad()
            self._runs[id(unit)].grad_seen = True
            self._maybe_reshard_after_backward(unit)

        return hook

    def _inputs_grad_done(self, unit: FlatParamUnit) -> None:
        self._runs[id(unit)].inputs_pending -= 1
        self._maybe_reshard_after_backward(unit)

    def _maybe_reshard_after_backward(self, unit: FlatParamUnit) -> None:
        # Free a unit only when nothing in backward can still read its parameters: its leaf
        # gradient is final (every op that used a trainable view ran) and its inputs have
        # their gradients (every op between the unit's inputs and outputs ran, including
        # ops on frozen parameters). The root waits for the end-of-backward callback.
        run = self._runs[id(unit)]
        if unit is self.root or run.inputs_pending > 0 or (run.wants_grad and not run.grad_seen):
            return
        unit.reshard()

    def _finish_backward(self) -> None:
        """Autograd engine callback: all of backward has run."""
        try:
            if not self.no_sync:
                for unit in self.units:  # gradients kept under no_sync whose hook did not fire
                    if unit.has_unreduced_grad():
                        unit.reduce_grad()
            for unit in self.units:
                unit.finish_reduction()
            for unit in self.units:
                unit.reshard()
        finally:
            self._runs = {id(u): _UnitRun() for u in self.units}
            self._callback_queued = False
            self.phase = Phase.IDLE
