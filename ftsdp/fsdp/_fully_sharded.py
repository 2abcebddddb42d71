"""The public wrapper: ``ftsdp.FullyShardedDataParallel`` (alias ``ftsdp.FSDP``).

Wrapping plans the units (``_wrap``), builds one FlatParameter per unit and keeps this rank's
shard (``_unit``), and installs the hooks that gather and reduce around each unit's forward and
backward (``_runtime``). The wrapped module keeps its structure and parameter names: between
iterations each original parameter is a 1-D ``nn.Parameter`` holding this rank's slice, which
is what ``named_parameters()`` yields and what the optimizer updates in place.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._collectives import (
    CommStats,
    all_gather_flat,
    all_reduce_flat,
    broadcast_flat,
)
from ._common import CPUOffload, MixedPrecision, Phase, ShardingStrategy
from ._init import build_units, check_same_structure, resolve_device, resolve_groups
from ._runtime import PrefetchOptions, Runtime
from ._state_dict import (
    ShardView,
    full_state_dict,
    load_full_state_dict,
    sharded_optim_state_dict,
    sharded_state_dict,
)
from ._streams import schedule_for
from ._unit import SHARDED_ATTR, STALE_ATTR, MemoryGauge, UnitOptions
from ._wrap import Policy, plan_units


class FullyShardedDataParallel(nn.Module):
    """Fully sharded data parallel training of ``module`` (PyTorch FSDP paper, VLDB 2023).

    Args:
        module: the model. Its parameters move into per-unit FlatParameters; create the
            optimizer afterwards from ``wrapped.parameters()``.
        process_group: the ranks that train this model together (default: the world).
        sharding_strategy: ``ShardingStrategy`` (or its name).
        auto_wrap_policy: module classes (each instance becomes a unit, nested instances nest)
            or a callable ``module -> bool``. ``None``: the whole model is one unit.
        device_id: the CUDA device index (or ``torch.device``) the shards live on; default:
            the device of the module's parameters.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding, so
            ranks that initialised differently start identical.
        deterministic: make gradients bitwise independent of the world size: each backward's
            gradient is kept, all are gathered at the reducing backward and summed in a fixed
            order, and the result is their MEAN (so do not divide the loss by the number of
            micro-batches). Rank r must run the r-th contiguous block of the step's
            micro-batches; every rank the same number. Costs k x the gradient traffic for k
            micro-batches per rank. See [Note: deterministic reduction] in ``_unit.py``.

    Every rank must wrap the same model structure; it is checked once here.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | tuple | None = None,
        sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        auto_wrap_policy: Policy = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        mixed_precision: MixedPrecision | None = None,
        cpu_offload: CPUOffload | None = None,
        backward_prefetch: bool = True,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_mesh: Any = None,
        deterministic: bool = False,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        _reject_unsupported(unsupported)
        _reject_wrapped(module)
        strategy = ShardingStrategy.parse(sharding_strategy)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise ValueError(
                f"mixed_precision must be an ftsdp.MixedPrecision, got {mixed_precision!r}"
            )
        if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
            raise ValueError(f"cpu_offload must be an ftsdp.CPUOffload, got {cpu_offload!r}")
        groups = resolve_groups(strategy, process_group, device_mesh)
        if groups.world is None and sync_module_states:
            raise ValueError("sync_module_states=True needs torch.distributed to be initialised")
        mp = mixed_precision or MixedPrecision()
        options = UnitOptions(
            device=resolve_device(module, device_id),
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            offload=bool(cpu_offload and cpu_offload.offload_params),
            deterministic=deterministic,
            sync_module_states=sync_module_states,
        )
        plans = plan_units(module, auto_wrap_policy)
        check_same_structure(plans, groups.world)
        self._comm_stats = CommStats()
        self._gauge = MemoryGauge()
        schedule = schedule_for(options.device, limit_all_gathers=limit_all_gathers)
        units = build_units(
            module, plans, options, groups, self._comm_stats, param_init_fn, self._gauge, schedule
        )
        for buffer in module.buffers():
            if sync_module_states:
                broadcast_flat(buffer, groups.world)
            if mp.buffer_dtype is not None and buffer.is_floating_point():
                buffer.data = buffer.data.to(mp.buffer_dtype)
        self.module = module
        self._groups = groups
        self._strategy = strategy
        self._units = units
        self._deterministic = deterministic
        self._sharded_params = {
            (id(module), name): info.sharded_param
            for unit in units
            for info in unit.infos
            for module, name in info.refs
        }
        prefetch = PrefetchOptions(
            backward=backward_prefetch,
            forward=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
        )
        cast_to = mp.param_dtype if mp.cast_forward_inputs else None
        self._runtime = Runtime(units, strategy, groups.world, prefetch, cast_to)
        self._runtime.register_hooks()
        _install_stale_optimizer_guard()

    # ------------------------------------------------------------------ nn.Module surface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (its hooks gather and free each unit around its use)."""
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._modules.get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Original parameter names (no wrapper prefix), each rank's 1-D slice (maybe empty).

        Always the local-slice parameters the optimizer updates, also while a unit is
        gathered (between a forward and its backward).
        """
        modules = (
            self.module.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
            if recurse
            else [(prefix, self.module)]
        )
        seen: set[int] = set()
        for module_prefix, module in modules:
            for name, p in module._parameters.items():
                if p is None:
                    continue
                p = self._sharded_params.get((id(module), name), p)
                if remove_duplicate:
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                yield (f"{module_prefix}.{name}" if module_prefix else name), p

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and any kept for a later reduction (``no_sync``)."""
        for unit in self._units:
            unit.drop_unreduced_grad()
        super().zero_grad(set_to_none=set_to_none)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's buffers under their original names."""
        return self.module.named_buffers(
            prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate
        )

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """The full, unsharded state with exactly the unwrapped module's keys.

        A collective: every rank must call it. Each rank gets the whole state (on the device
        the shards live on); for large models save the sharded view instead.
        """
        if args or kwargs:
            raise ValueError(
                "FSDP.state_dict() takes no arguments: it returns the full state with the "
                "unwrapped module's keys"
            )
        self._require_idle("state_dict()")
        return full_state_dict(self._units, self.module, self._param_names())

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a full state dict (keys of the unwrapped module) into each rank's shards."""
        if assign:
            raise ValueError("FSDP.load_state_dict does not support assign=True")
        self._require_idle("load_state_dict()")
        missing, unexpected = load_full_state_dict(
            self._units, self.module, self._param_names(), state_dict, strict
        )
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ------------------------------------------------------------------ training helpers
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded) without communication.

        The backward passes inside keep each unit's full flat gradient; the first backward
        outside reduces the sum once. More memory, less traffic (see the paper, Section 3.3).
        """
        previous = self._runtime.no_sync
        self._runtime.no_sync = True
        try:
            yield
        finally:
            self._runtime.no_sync = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients in place by their global norm over all shards; returns that norm."""
        self._require_idle("clip_grad_norm_()")
        max_norm, norm_type = float(max_norm), float(norm_type)
        grads = [
            info.sharded_param.grad
            for unit in self._units
            for info in unit.trainable
            if info.sharded_param.grad is not None
        ]
        device = self._units[0].device
        if self._deterministic and norm_type != math.inf:
            total = self._deterministic_norm(norm_type)
        elif norm_type == math.inf:
            local = max((g.abs().max() for g in grads if g.numel()), default=None)
            total = torch.zeros((), device=device) if local is None else local.float()
            all_reduce_flat(total, self._groups.shard, op=dist.ReduceOp.MAX)
        else:
            total = torch.zeros((), dtype=torch.float32, device=device)
            for g in grads:
                total += g.float().abs().pow(norm_type).sum()
            all_reduce_flat(total, self._groups.shard)
            total = total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return total

    def _deterministic_norm(self, norm_type: float) -> torch.Tensor:
        """The norm over each unit's full gradient in unit order: the same for any world size."""
        total = torch.zeros((), dtype=torch.float64, device=self._units[0].device)
        for unit in self._units:
            if not unit.trainable or unit.sharded_grad is None:
                continue
            full = torch.empty(unit.padded_numel, dtype=unit.dtype, device=unit.device)
            all_gather_flat(full, unit.on_device(unit.sharded_grad), unit.shard_group)
            mask = torch.zeros(unit.padded_numel, dtype=torch.bool, device=unit.device)
            for info in unit.trainable:
                mask[info.offset : info.offset + info.numel] = True
            total += full[: unit.numel][mask[: unit.numel]].double().abs().pow(norm_type).sum()
        return total.pow(1.0 / norm_type).float()

    # ------------------------------------------------------------------ sharded state
    def sharded_state_dict(self) -> dict[str, ShardView]:
        """This rank's flat range of every parameter and persistent buffer (no communication).

        Tied parameters appear once, under their first name. The ``local`` tensors alias the
        live shards: copying into them loads a checkpoint in place.
        """
        return sharded_state_dict(self._units, self.module, self._param_names())

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, parameter-shaped state as ShardViews."""
        return sharded_optim_state_dict(self._units, self._param_names(), optimizer)

    # ------------------------------------------------------------------ introspection
    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._strategy

    @property
    def comm_stats(self) -> CommStats:
        """Collective calls and per-rank bytes since wrapping (``.reset()`` to start over)."""
        return self._comm_stats

    def units(self) -> list[dict[str, Any]]:
        """One dict per unit: its module name, numel, padded numel, shard numel, state."""
        return [
            {
                "name": u.fqn,
                "params": [info.fqn for info in u.infos],
                "numel": u.numel,
                "padded_numel": u.padded_numel,
                "shard_numel": u.shard_numel,
                "state": u.state.value,
            }
            for u in self._units
        ]

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds (the accounting the logs and the benchmark use).

        ``sharded_param_bytes`` / ``sharded_grad_bytes``: the shards and sharded gradients;
        ``optimizer_state_bytes``: tensors in ``optimizer.state`` for this model's parameters
        (when an optimizer is given); ``unsharded_param_bytes``: full buffers allocated now;
        ``peak_unsharded_param_bytes``: the most allocated at once since wrapping;
        ``largest_unit_bytes``: the biggest unit's full buffer.
        """
        stats = {
            "sharded_param_bytes": sum(
                u.shard.numel() * u.shard.element_size() for u in self._units
            ),
            "sharded_grad_bytes": sum(
                g.numel() * g.element_size()
                for u in self._units
                if (g := u.sharded_grad) is not None
            ),
            "unsharded_param_bytes": self._gauge.now,
            "peak_unsharded_param_bytes": self._gauge.peak,
            "largest_unit_bytes": max((u.full_bytes for u in self._units), default=0),
        }
        if optimizer is not None:
            mine = {id(p) for _, p in self.named_parameters()}
            stats["optimizer_state_bytes"] = sum(
                v.numel() * v.element_size()
                for p, state in optimizer.state.items()
                if id(p) in mine
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
        return stats

    def _param_names(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.named_parameters(remove_duplicate=False))

    def _require_idle(self, what: str) -> None:
        if self._runtime.phase is not Phase.IDLE:
            raise RuntimeError(f"{what} cannot run during {self._runtime.phase.value.lower()}")


FSDP = FullyShardedDataParallel


def _reject_wrapped(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedDataParallel):
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"{where} is already an ftsdp.FSDP wrapper; wrap the original module once "
                "and use auto_wrap_policy for inner units"
            )
    for name, p in module.named_parameters():
        if getattr(p, SHARDED_ATTR, False) or getattr(p, STALE_ATTR, False):
            raise ValueError(
                f"parameter {name!r} already belongs to an ftsdp.FSDP wrapper; a module can be "
                "wrapped only once"
            )


# torch FSDP arguments a user may carry over; each gets a clear "not supported (yet)".
_TORCH_FSDP_ARGS = {
    "use_orig_params": "ftsdp always exposes the original parameters (as 1-D local slices)",
    "ignored_modules": "not supported: every parameter of the module is sharded",
    "ignored_states": "not supported: every parameter of the module is sharded",
}


def _reject_unsupported(kwargs: dict[str, Any]) -> None:
    for name in kwargs:
        if name in _TORCH_FSDP_ARGS:
            raise ValueError(f"FSDP argument {name}=: {_TORCH_FSDP_ARGS[name]}")
    if kwargs:
        raise TypeError(f"FSDP got unexpected keyword arguments {sorted(kwargs)}")


_stale_guard: Any = None


def _install_stale_optimizer_guard() -> None:
    """Refuse ``optimizer.step()`` on parameters that wrapping retired (created too early)."""
    global _stale_guard
    if _stale_guard is None:
        _stale_guard = register_optimizer_step_pre_hook(_reject_stale)


def _reject_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, STALE_ATTR, False):
                raise ValueError(
                    f"{type(optimizer).__name__} was created before ftsdp.FSDP wrapped the "
                    "model: it holds the original parameters, which no longer train. Create "
                    "the optimizer after wrapping, from wrapped_model.parameters()"
                )
