"""Wrap planning: which modules become units and own which parameters (docs/engine.md)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

logger = logging.getLogger(__name__)

Policy = Iterable[type[nn.Module]] | Callable[..., Any] | None


@dataclass
class ParamPlan:
    """One original parameter and every ``(module, attribute)`` that holds it."""

    fqn: str  # the first name it is reachable by from the root (state_dict's first key)
    param: nn.Parameter
    refs: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class UnitPlan:
    """A module that becomes a unit, its parent unit and the parameters it will flatten."""

    module: nn.Module
    fqn: str  # "" for the root
    parent: int | None
    params: list[ParamPlan] = field(default_factory=list)


@dataclass(frozen=True)
class Ignored:
    """Modules and parameters no unit manages: whole on every rank, not reduced (as torch)."""

    modules: frozenset[nn.Module] = frozenset()
    params: frozenset[nn.Parameter] = frozenset()

    @classmethod
    def build(cls, root: nn.Module, ignored_modules: Any, ignored_states: Any) -> Ignored:
        """From FSDP's ``ignored_modules`` (modules) and ``ignored_states`` (either kind)."""
        modules: set[nn.Module] = set()
        params: set[nn.Parameter] = set()
        for arg, items in (
            ("ignored_modules", ignored_modules),
            ("ignored_states", ignored_states),
        ):
            if items is None:
                continue
            if isinstance(items, (nn.Module, nn.Parameter)):
                items = [items]
            for item in items:
                if isinstance(item, nn.Parameter):
                    if arg == "ignored_modules":
                        raise ValueError(
                            "ignored_modules= takes modules; pass parameters as ignored_states="
                        )
                    params.add(item)
                elif isinstance(item, nn.Module):
                    if item is root:
                        raise ValueError(
                            f"{arg}= contains the wrapped module itself; ignore submodules, or "
                            "do not wrap the model"
                        )
                    modules.update(item.modules())
                    params.update(item.parameters())
                else:
                    raise ValueError(
                        f"{arg}= must hold nn.Module or nn.Parameter objects, got "
                        f"{type(item).__name__}"
                    )
        return cls(frozenset(modules), frozenset(params))


def policy_predicate(
    policy: Policy, root: nn.Module, ignored: Ignored, root_kwargs: dict[str, Any]
) -> Callable[[nn.Module], bool]:
    """An ``auto_wrap_policy`` as ``module -> bool`` (torch's evaluated on ``root`` once)."""
    if policy is None:
        return lambda module: False
    if isinstance(policy, type):
        policy = {policy}
    if is_torch_policy(policy):
        targets = torch_policy_targets(policy, root, ignored, root_kwargs)
        return lambda module: id(module) in targets
    if callable(policy):
        return policy
    if not isinstance(policy, (set, frozenset, list, tuple)):
        raise ValueError(
            f"auto_wrap_policy={policy!r} must be a set of nn.Module classes, a callable "
            "module -> bool, or a torch FSDP policy (ModuleWrapPolicy, CustomPolicy, or a "
            "callable (module, recurse, nonwrapped_numel) such as "
            "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}))"
        )
    classes = tuple(policy)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"auto_wrap_policy contains {cls!r}, which is not an nn.Module class; "
                "pass module classes, e.g. auto_wrap_policy={Block}"
            )
    return lambda module: isinstance(module, classes)


def is_torch_policy(policy: Policy) -> bool:
    """A torch ``_Policy``, or a callable taking ``(module, recurse, nonwrapped_numel)``."""
    if hasattr(policy, "_run_policy"):
        return True
    if not callable(policy) or isinstance(policy, type):
        return False
    try:
        inspect.signature(policy).bind(module=None, recurse=True, nonwrapped_numel=0)
    except (TypeError, ValueError):  # ValueError: no signature to read
        return False
    return True


def torch_policy_targets(
    policy: Any, root: nn.Module, ignored: Ignored, root_kwargs: dict[str, Any]
) -> set[int]:
    """ids of the modules (never ``root``) torch FSDP would wrap with ``policy``."""
    if hasattr(policy, "_run_policy"):
        chosen = policy._run_policy(root, set(ignored.modules), dict(root_kwargs))
        names = {id(m): name for name, m in root.named_modules()}
        for module, kwargs in chosen.items():
            if module is root:
                continue
            _check_same_kwargs(names.get(id(module), "?"), kwargs or {}, root_kwargs)
        return {id(m) for m in chosen if m is not root}
    targets: set[int] = set()

    def visit(module: nn.Module, only_children: bool) -> int:
        """torch's ``_recursive_wrap``: returns the numel wrapped in ``module``'s subtree."""
        total = sum(p.numel() for p in module.parameters() if p not in ignored.params)
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        wrapped = 0
        for child in module.children():
            if child not in ignored.modules:
                wrapped += visit(child, False)
        if not only_children and policy(
            module=module, recurse=False, nonwrapped_numel=total - wrapped
        ):
            targets.add(id(module))
            return total
        return wrapped

    visit(root, True)
    return targets


def _normal(key: str, value: Any) -> Any:
    """An FSDP argument in ftsdp's form, so torch's and ftsdp's spellings compare equal."""
    from ._common import ShardingStrategy, as_backward_prefetch, as_cpu_offload, as_mixed_precision

    convert = {
        "sharding_strategy": ShardingStrategy.parse,
        "mixed_precision": as_mixed_precision,
        "cpu_offload": as_cpu_offload,
        "backward_prefetch": as_backward_prefetch,
    }.get(key)
    return value if convert is None else convert(value)


def _check_same_kwargs(name: str, kwargs: dict[str, Any], root_kwargs: dict[str, Any]) -> None:
    differing = []
    for key, value in kwargs.items():
        if key not in root_kwargs:
            differing.append(f"{key}={value!r} (not an FSDP argument ftsdp knows)")
            continue
        base = root_kwargs[key]
        try:
            same = value is base or bool(_normal(key, value) == _normal(key, base))
        except Exception:  # e.g. tensors, whose == is elementwise
            same = False
        if not same:
            differing.append(f"{key}={value!r} (the root has {base!r})")
    if differing:
        raise ValueError(
            f"auto_wrap_policy asks for module {name!r} to be wrapped with its own FSDP "
            f"arguments: {', '.join(differing)}. ftsdp applies one set of arguments to every "
            "unit of a model: return True (the root's arguments) for this module, or pass "
            "the argument to FSDP(...) for the whole model"
        )


def plan_units(
    root: nn.Module, policy: Policy, ignored: Ignored, root_kwargs: dict[str, Any]
) -> list[UnitPlan]:
    """Units in pre-order (root first) with their parameters, shared ones at the LCA unit;
    ``root_kwargs``: the FSDP arguments, which a torch ``CustomPolicy`` may not change."""
    wants_unit = policy_predicate(policy, root, ignored, root_kwargs)
    units: list[UnitPlan] = [UnitPlan(module=root, fqn="", parent=None)]
    unit_of_module: dict[int, int] = {id(root): 0}
    params: dict[int, ParamPlan] = {}
    users: dict[int, set[int]] = {}  # id(param) -> units whose modules hold it
    seen_refs: set[tuple[int, str]] = set()

    def visit(module: nn.Module, path: str, owner: int) -> None:
        for name, p in module._parameters.items():
            if p is None or p in ignored.params:
                continue
            fqn = f"{path}.{name}" if path else name
            plan = params.setdefault(id(p), ParamPlan(fqn=fqn, param=p))
            users.setdefault(id(p), set()).add(owner)
            if (id(module), name) not in seen_refs:
                seen_refs.add((id(module), name))
                plan.refs.append((module, name))
        for child_name, child in module._modules.items():
            if child is None or child in ignored.modules:
                continue
            child_path = f"{path}.{child_name}" if path else child_name
            child_owner = owner
            if id(child) in unit_of_module:
                child_owner = unit_of_module[id(child)]
            elif wants_unit(child):
                units.append(UnitPlan(module=child, fqn=child_path, parent=owner))
                child_owner = unit_of_module[id(child)] = len(units) - 1
            visit(child, child_path, child_owner)

    visit(root, "", 0)
    if policy is not None and len(units) == 1 and is_torch_policy(policy):
        logger.warning(
            "auto_wrap_policy=%s selected no submodule of %s: the whole model is one unit, "
            "gathered whole for every forward (as torch FSDP does with this policy)",
            _describe(policy),
            type(root).__name__,
        )
    elif policy is not None and len(units) == 1 and not wants_unit(root):
        kinds = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"auto_wrap_policy={_describe(policy)} matched no module of "
            f"{type(root).__name__}; the module types present are: {', '.join(kinds)}"
        )
    for pid, plan in params.items():
        owner = _lowest_common_ancestor(units, users[pid])
        units[owner].params.append(plan)
    return units


def _lowest_common_ancestor(units: list[UnitPlan], members: set[int]) -> int:
    def chain(index: int | None) -> list[int]:
        out = []
        while index is not None:
            out.append(index)
            index = units[index].parent
        return out

    chains = [chain(i) for i in sorted(members)]
    common = set(chains[0]).intersection(*map(set, chains[1:]))
    return next(i for i in chains[0] if i in common)


def _describe(policy: Policy) -> str:
    if isinstance(policy, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in policy)) + "}"
    return repr(policy)
