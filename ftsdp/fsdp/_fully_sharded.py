"""``ftsdp.FSDP``, with torch FSDP1's arguments and methods (docs/migrating.md)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _state_dict, _unit
from ._collectives import CommStats, all_reduce_flat, broadcast_flat
from ._common import (
    CONFIG_TYPES,
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    Phase,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    as_backward_prefetch,
    as_config,
    as_cpu_offload,
    as_mixed_precision,
    as_state_dict_type,
)
from ._runtime import Runtime
from ._streams import schedule_for
from ._unit import SHARDED_ATTR, STALE_ATTR, MemoryGauge, UnitOptions
from ._wrap import Ignored, Policy, plan_units

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ._unit import ProcessGroups

logger = logging.getLogger(__name__)


def _deprecated(name: str, alternative: str) -> Callable[..., Any]:
    """A method of torch FSDP that ftsdp refuses (deprecated in torch), naming ``alternative``."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"FSDP.{name} (deprecated in torch FSDP) is not supported by ftsdp; use {alternative}"
        )

    refuse.__doc__ = f"Not supported: use ``{alternative}``."
    return refuse


class FullyShardedDataParallel(nn.Module):
    """Fully sharded data parallel training of ``module`` (PyTorch FSDP paper, VLDB 2023).

    Args:
        module: the model; create the optimizer afterwards from ``wrapped.parameters()``.
        process_group: the ranks that train this model together (default: the world).
        sharding_strategy: ``ShardingStrategy`` (or its name, or torch FSDP's enum).
        auto_wrap_policy: module classes, a callable ``module -> bool``, or a torch FSDP
            policy (docs/engine.md); ``None``: one unit.
        device_id: the CUDA device index (or ``torch.device``); default: the parameters'.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding.
        mixed_precision, cpu_offload: ftsdp's or torch FSDP's config.
        backward_prefetch, forward_prefetch, limit_all_gathers: see docs/engine.md.
        param_init_fn: initialises a meta-device model's modules.
        use_orig_params, ignored_modules, ignored_states: as in torch FSDP.
        deterministic: gradients bitwise independent of the world size, the MEAN over
            micro-batches, padding passes left out (docs/engine.md, "Deterministic mode").
    Every rank must wrap the same model structure (checked here)."""

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: ProcessGroups | None = None,
        sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
        auto_wrap_policy: Policy = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        mixed_precision: MixedPrecision | None = None,
        cpu_offload: CPUOffload | None = None,
        backward_prefetch: bool | BackwardPrefetch | None = True,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_mesh: DeviceMesh | None = None,
        deterministic: bool = False,
        use_orig_params: bool = True,
        ignored_modules: Iterable[nn.Module] | None = None,
        ignored_states: Iterable[nn.Parameter | nn.Module] | None = None,
        **unsupported: Any,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"FSDP wraps an nn.Module, got {type(module).__name__}")
        if unsupported:
            raise TypeError(
                f"FSDP got unexpected keyword arguments {sorted(unsupported)}; docs/migrating.md "
                "lists the arguments ftsdp takes, torch FSDP's among them"
            )
        _reject_wrapped(module)
        # What torch FSDP would hand every auto-wrapped unit (the arguments as given, before any
        # is converted below): a CustomPolicy may not differ.
        root_kwargs = {
            "process_group": process_group,
            "sharding_strategy": sharding_strategy,
            "cpu_offload": cpu_offload,
            "backward_prefetch": backward_prefetch,
            "mixed_precision": mixed_precision,
            "param_init_fn": param_init_fn,
            "device_id": device_id,
            "sync_module_states": sync_module_states,
            "forward_prefetch": forward_prefetch,
            "limit_all_gathers": limit_all_gathers,
            "use_orig_params": use_orig_params,
            "ignored_states": ignored_states,
            "device_mesh": device_mesh,
            "deterministic": deterministic,
        }
        strategy = ShardingStrategy.parse(sharding_strategy)
        mixed_precision = as_mixed_precision(mixed_precision)
        cpu_offload = as_cpu_offload(cpu_offload)
        backward_prefetch = as_backward_prefetch(backward_prefetch)
        if mixed_precision is not None and mixed_precision._module_classes_to_ignore:
            logger.warning(
                "MixedPrecision(_module_classes_to_ignore=%s) is not honoured by ftsdp: those "
                "modules compute in param_dtype like the rest",
                tuple(c.__name__ for c in mixed_precision._module_classes_to_ignore),
            )
        if not use_orig_params:
            logger.warning(
                "FSDP(use_orig_params=False): ftsdp always exposes the original parameters "
                "(named_parameters() yields each parameter's 1-D local slice under its own "
                "name; there is no FlatParameter to optimise), as use_orig_params=True does "
                "in torch FSDP; training is the same"
            )
        ignored = Ignored.build(module, ignored_modules, ignored_states)
        groups = _unit.resolve_groups(strategy, process_group, device_mesh)
        if groups.world is None and sync_module_states:
            raise ValueError("sync_module_states=True needs torch.distributed to be initialised")
        mp = mixed_precision or MixedPrecision()
        options = UnitOptions(
            device=_unit.resolve_device(module, device_id),
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            offload=bool(cpu_offload and cpu_offload.offload_params),
            deterministic=deterministic,
            sync_module_states=sync_module_states,
        )
        plans = plan_units(module, auto_wrap_policy, ignored, root_kwargs)
        _unit.check_same_structure(plans, groups.world)
        self._comm_stats = CommStats()
        self._gauge = MemoryGauge()
        schedule = schedule_for(options.device, limit_all_gathers=limit_all_gathers)
        units = _unit.build_units(
            module, plans, options, groups, self._comm_stats, param_init_fn, self._gauge, schedule
        )
        # state dicts give the buffers in their own dtype, as torch FSDP's do
        self._buffer_dtypes: dict[str, torch.dtype] = {}
        for name, buffer in module.named_buffers():
            if sync_module_states:
                broadcast_flat(buffer, groups.world)
            if mp.buffer_dtype is not None and buffer.is_floating_point():
                self._buffer_dtypes[name] = buffer.dtype
                buffer.data = buffer.data.to(mp.buffer_dtype)
        self.module = module
        self._ignored = ignored
        self._summoned = False  # inside summon_full_params: modules hold full parameters
        self._sd_settings = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
        )
        self._dtensor_mesh: Any = None  # SHARDED_STATE_DICT's mesh, made on first use
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
        self._runtime = Runtime(
            units,
            strategy,
            groups.world,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            cast_root_inputs_to=mp.param_dtype if mp.cast_root_forward_inputs else None,
            cast_inputs_to=mp.param_dtype if mp.cast_forward_inputs else None,
        )
        # a parent module's load_state_dict() (the wrapper inside a GAN, an EMA holder...)
        self._parent_load: tuple[int, int] | None = None
        self._register_load_state_dict_pre_hook(_load_from_parent, with_module=True)
        self.register_load_state_dict_post_hook(_drop_inner_keys)
        _install_stale_optimizer_guard()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``.to()``, ``.float()``, ``.bfloat16()``, ``.cuda()``...: refused before anything
        changes when they would change the sharded parameters' dtype or device (the units keep
        views of them); a call that changes neither (``.float()`` of an fp32 model) is fine."""
        kinds = {(p.dtype, p.device): p for p in self._sharded_params.values()}
        for p in kinds.values():  # one probe per dtype and device
            probe = p.detach()[:0]
            out = fn(probe)
            if out.dtype != probe.dtype or out.device != probe.device:
                raise RuntimeError(
                    f"ftsdp.FSDP: the wrapped model's parameters cannot change from "
                    f"{probe.dtype} on {probe.device} to {out.dtype} on {out.device} after "
                    "wrapping: move and cast the model before wrapping it (device_id= for the "
                    "device), or use MixedPrecision(param_dtype=...) to compute in another dtype"
                )
        return super()._apply(fn, recurse)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (its hooks gather and free each unit around its use)."""
        if self._summoned:
            raise RuntimeError(
                "FSDP forward cannot run inside summon_full_params(); leave the context first"
            )
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
        """Original names, this rank's 1-D slices (full inside ``summon_full_params``)."""
        return self._named_params(prefix, recurse, remove_duplicate, sharded=not self._summoned)

    def _named_params(
        self, prefix: str, recurse: bool, remove_duplicate: bool, sharded: bool
    ) -> Iterator[tuple[str, nn.Parameter]]:
        modules = (
            self.module.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
            if recurse
            else [(prefix, self.module)]
        )
        seen: set[int] = set()
        for module_prefix, module in modules:
            for name, param in module._parameters.items():
                if param is None:
                    continue
                p = self._sharded_params.get((id(module), name), param) if sharded else param
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

    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The unwrapped module's keys, in the ``state_dict_type``'s form (a collective).

        Called by a parent module's ``state_dict()``, the keys go into its ``destination``
        under the wrapper's ``prefix`` (``net.emb.weight``), as torch FSDP1's do; parameters
        are always new full tensors, ``keep_vars`` keeps the buffers themselves."""
        self._require_idle("state_dict()")
        state = _state_dict.model_state_dict(self, keep_vars=keep_vars)
        if destination is None and not prefix:
            return state
        out: dict[str, Any] = {} if destination is None else destination
        for key, value in state.items():
            out[prefix + key] = value
        return out

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load full tensors (or DTensors of them: a collective) into each rank's shards.

        A parent module's ``load_state_dict()`` loads the wrapper's entries (those under its
        prefix) the same way, through the hooks below."""
        if assign:
            raise ValueError("FSDP.load_state_dict does not support assign=True")
        self._require_idle("load_state_dict()")
        missing, unexpected = _state_dict.load_full_state_dict(
            self._units, self.module, state_dict, strict
        )
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communication; the next backward outside reduces."""
        previous = self._runtime.no_sync
        self._runtime.no_sync = True
        try:
            yield
        finally:
            self._runtime.no_sync = previous

    @contextlib.contextmanager
    def padding(self) -> Iterator[None]:
        """A pass adding no gradient: it runs every collective (a rank with fewer micro-batches
        keeps in step), its gradients count as zeros, left out of the deterministic mean."""
        previous = self._runtime.padding
        self._runtime.padding = True
        try:
            yield
        finally:
            self._runtime.padding = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients in place by their global norm over all shards; returns that norm
        (ignored parameters count from this rank only, as in torch FSDP)."""
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
        unmanaged = self._ignored_grads()
        if unmanaged:  # not sharded, not reduced: this rank's own, added after the reduction
            local = torch.stack([g.detach().float().norm(norm_type) for g in unmanaged])
            local = local.to(total.device).norm(norm_type)
            if norm_type == math.inf:
                total = torch.maximum(total, local)
            else:
                total = (total.pow(norm_type) + local.pow(norm_type)).pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        for g in unmanaged:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    def _ignored_grads(self) -> list[torch.Tensor]:
        ignored = self._ignored.params
        return [p.grad for p in self.module.parameters() if p in ignored and p.grad is not None]

    def _deterministic_norm(self, norm_type: float) -> torch.Tensor:
        """The norm over each unit's full gradient in unit order: the same for any world size."""
        total = torch.zeros((), dtype=torch.float64, device=self._units[0].device)
        for unit in self._units:
            if not unit.trainable or unit.sharded_grad is None:
                continue
            full = _state_dict.gather_flat(unit, unit.sharded_grad)
            for info in unit.trainable:
                piece = full[info.offset : info.offset + info.numel]
                total += piece.double().abs().pow(norm_type).sum()
        return total.pow(1.0 / norm_type).float()

    def sharded_state_dict(self) -> dict[str, _state_dict.ShardView]:
        """ShardViews of every parameter (tied once) and persistent buffer, aliasing the shards."""
        return _state_dict.sharded_state_dict(self._units, self.module)

    def sharded_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, parameter-shaped state as ShardViews."""
        return _state_dict.sharded_optim_state_dict(self._units, self._param_names(), optimizer)

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        """The strategy the model was wrapped with."""
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
        """Bytes this rank holds, by role (docs/engine.md, "Accounting")."""
        stats = {
            "sharded_param_bytes": sum(u.shard.nbytes for u in self._units),
            "sharded_grad_bytes": sum(
                g.nbytes for u in self._units if (g := u.sharded_grad) is not None
            ),
            "unsharded_param_bytes": self._gauge.now,
            "peak_unsharded_param_bytes": self._gauge.peak,
            "largest_unit_bytes": max((u.full_bytes for u in self._units), default=0),
        }
        if optimizer is not None:
            mine = {id(p) for _, p in self.named_parameters()}
            stats["optimizer_state_bytes"] = sum(
                v.nbytes
                for p, state in optimizer.state.items()
                if id(p) in mine
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
        return stats

    def _param_names(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._named_params("", True, False, sharded=True))

    def _require_idle(self, what: str) -> None:
        if self._runtime.phase is not Phase.IDLE:
            raise RuntimeError(f"{what} cannot run during {self._runtime.phase.value.lower()}")
        if self._summoned:
            raise RuntimeError(f"{what} cannot run inside summon_full_params()")

    def __getitem__(self, key: int) -> Any:
        """Index the wrapped module (an ``nn.Sequential``), as torch FSDP does."""
        return self.module[key]  # type: ignore[index]

    def check_is_root(self) -> bool:
        """Always ``True``: an ftsdp wrapper is the root of its units (torch FSDP's method)."""
        return True

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """The ftsdp wrappers in ``module`` (one per model: ``root_only`` changes nothing)."""
        return [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Choose what ``state_dict()`` and ``FSDP.optim_state_dict`` return for the wrappers
        in ``module`` (``None``: default configs); returns the previous settings."""
        kind = as_state_dict_type(state_dict_type)
        if kind is StateDictType.LOCAL_STATE_DICT:
            raise ValueError(
                "StateDictType.LOCAL_STATE_DICT (torch FSDP's FlatParameter shards) is not "
                "supported by ftsdp: use StateDictType.SHARDED_STATE_DICT (one DTensor per "
                "parameter, savable with torch.distributed.checkpoint and loadable at any "
                "world size) or model.sharded_state_dict()"
            )
        model_cls, optim_cls = CONFIG_TYPES[kind]
        settings = StateDictSettings(
            kind,
            as_config(state_dict_config, model_cls),
            as_config(optim_state_dict_config, optim_cls),
        )
        wrappers = _wrappers_in(module, "set_state_dict_type")
        previous = wrappers[0]._sd_settings
        for wrapper in wrappers:
            wrapper._sd_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of the wrappers in ``module``."""
        return _wrappers_in(module, "get_state_dict_type")[0]._sd_settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Iterator[None]:
        """``set_state_dict_type`` for the duration of a ``with`` block."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            for wrapper in _wrappers_in(module, "state_dict_type"):
                wrapper._sd_settings = previous

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, as torch FSDP returns it;
        ``optim_state_dict``: a state dict to convert instead of the live state. A collective."""
        wrapper = _wrappers_in(model, "optim_state_dict")[0]
        wrapper._require_idle("optim_state_dict()")
        return _state_dict.optim_state_dict(wrapper, optim, optim_state_dict)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from what ``optim_state_dict`` returned
        (``load_directly=True`` also loads it). A collective."""
        if is_named_optimizer:
            raise ValueError(
                "optim_state_dict_to_load(is_named_optimizer=True) is not supported by ftsdp; "
                "use a torch.optim optimizer"
            )
        wrapper = _wrappers_in(model, "optim_state_dict_to_load")[0]
        wrapper._require_idle("optim_state_dict_to_load()")
        result = _state_dict.optim_state_dict_to_load(wrapper, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Full ``nn.Parameter``s in the block, edits written back on exit, as in torch FSDP."""
        with contextlib.ExitStack() as stack:
            for wrapper in _wrappers_in(module, "summon_full_params"):
                stack.enter_context(
                    _state_dict.summon_full_params(
                        wrapper, recurse, writeback, rank0_only, offload_to_cpu, with_grads
                    )
                )
            yield

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``fn`` on every submodule inside ``summon_full_params`` (original shapes)."""
        with FullyShardedDataParallel.summon_full_params(self):
            super().apply(fn)
        return self

    # torch FSDP's deprecated optimizer-state APIs, each refused naming its replacement
    full_optim_state_dict = _deprecated(
        "full_optim_state_dict", "FSDP.optim_state_dict(model, optim)"
    )
    shard_full_optim_state_dict = _deprecated(
        "shard_full_optim_state_dict", "FSDP.optim_state_dict_to_load"
    )
    scatter_full_optim_state_dict = _deprecated(
        "scatter_full_optim_state_dict",
        "FSDP.optim_state_dict_to_load under FullOptimStateDictConfig(rank0_only=True)",
    )
    flatten_sharded_optim_state_dict = _deprecated(
        "flatten_sharded_optim_state_dict", "FSDP.optim_state_dict_to_load"
    )
    rekey_optim_state_dict = _deprecated(
        "rekey_optim_state_dict", "FSDP.optim_state_dict (keyed by name)"
    )

    def register_comm_hook(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: ftsdp's collectives are fixed (see docs/engine.md)."""
        raise NotImplementedError(
            "FSDP.register_comm_hook is not supported by ftsdp; gradient compression is not "
            "available, use mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16) to "
            "halve the reduce-scatter traffic"
        )


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


def _load_from_parent(
    wrapper: FullyShardedDataParallel,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """A parent's ``load_state_dict()`` reaching the wrapper (a load-state-dict pre-hook): the
    entries under ``prefix`` leave the parent's dict and load as ``wrapper.load_state_dict``
    loads them. The keys the wrapped model lacks, and those it does not know, are reported
    under ``prefix`` (``strict`` here is always True: the parent raises on them if its own
    ``strict`` is)."""
    keys = [key for key in state_dict if key.startswith(prefix)]
    mine = {key[len(prefix) :]: state_dict.pop(key) for key in keys}
    assign = local_metadata.get("assign_to_params_buffers", False)
    result = wrapper.load_state_dict(mine, strict=False, assign=assign)
    missing_keys.extend(prefix + key for key in result.missing_keys)
    unexpected_keys.extend(prefix + key for key in result.unexpected_keys)
    wrapper._parent_load = (len(missing_keys), len(unexpected_keys))


def _drop_inner_keys(wrapper: FullyShardedDataParallel, incompatible: Any) -> None:
    """After the parent's load went on into ``wrapper.module`` (its entries taken by
    ``_load_from_parent``, it finds none): forget what that reported (``net.module.*``)."""
    if wrapper._parent_load is None:
        return
    n_missing, n_unexpected = wrapper._parent_load
    wrapper._parent_load = None
    del incompatible.missing_keys[n_missing:]
    del incompatible.unexpected_keys[n_unexpected:]


def _wrappers_in(module: nn.Module, what: str) -> list[FullyShardedDataParallel]:
    wrappers = FullyShardedDataParallel.fsdp_modules(module)
    if not wrappers:
        raise ValueError(
            f"FSDP.{what}: {type(module).__name__} holds no ftsdp.FSDP wrapper; pass the "
            "wrapped model (or a module containing it)"
        )
    return wrappers


@functools.cache
def _install_stale_optimizer_guard() -> Any:
    """Refuse ``optimizer.step()`` on parameters that wrapping retired (created too early)."""
    return register_optimizer_step_pre_hook(_reject_stale)


def _reject_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, STALE_ATTR, False):
                raise ValueError(
                    f"{type(optimizer).__name__} holds parameters that ftsdp.FSDP retired when "
                    "it wrapped the model (the optimizer was created before wrapping, or from "
                    "references to parameters taken before it); they no longer train. Create "
                    "the optimizer after wrapping, from wrapped_model.parameters() or "
                    "named_parameters()"
                )
