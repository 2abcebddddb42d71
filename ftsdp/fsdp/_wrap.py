"""Wrap planning: which modules become units, and which unit owns each parameter.

The root module is always a unit (it takes the parameters no other unit claims). The
``auto_wrap_policy`` picks more units: a set of module classes (every instance becomes its own
unit, nested instances nest) or a callable ``policy(module) -> bool``.

[Note: shared parameters live in the lowest common ancestor unit]
A parameter used by modules of several units (a token embedding tied to the output head) must
be unsharded whenever any of those modules runs. The unit that is the lowest common ancestor
of all its users is unsharded for the whole time its descendants run, so the parameter is put
there. For GPT with ``auto_wrap_policy={Block}`` the tied weight lands in the root unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

Policy = Iterable[type[nn.Module]] | Callable[[nn.Module], bool] | None


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


def policy_predicate(policy: Policy) -> Callable[[nn.Module], bool]:
    """Turn an ``auto_wrap_policy`` into ``module -> bool``, rejecting malformed policies."""
    if policy is None:
        return lambda module: False
    if isinstance(policy, type):
        policy = {policy}
    if callable(policy) and not isinstance(policy, (set, frozenset, list, tuple)):
        return policy
    if not isinstance(policy, (set, frozenset, list, tuple)):
        raise ValueError(
            f"auto_wrap_policy={policy!r} must be a set of nn.Module classes or a callable "
            "module -> bool"
        )
    classes = tuple(policy)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(
                f"auto_wrap_policy contains {cls!r}, which is not an nn.Module class; "
                "pass module classes, e.g. auto_wrap_policy={Block}"
            )
    return lambda module: isinstance(module, classes)


def plan_units(root: nn.Module, policy: Policy) -> list[UnitPlan]:
    """Units in pre-order (root first) with their parameters, shared ones at the LCA unit."""
    wants_unit = policy_predicate(policy)
    units: list[UnitPlan] = [UnitPlan(module=root, fqn="", parent=None)]
    unit_of_module: dict[int, int] = {id(root): 0}
    params: dict[int, ParamPlan] = {}
    users: dict[int, set[int]] = {}  # id(param) -> units whose modules hold it
    seen_refs: set[tuple[int, str]] = set()

    def visit(module: nn.Module, path: str, owner: int) -> None:
        for name, p in module._parameters.items():
            if p is None:
                continue
            fqn = f"{path}.{name}" if path else name
            plan = params.setdefault(id(p), ParamPlan(fqn=fqn, param=p))
            users.setdefault(id(p), set()).add(owner)
            if (id(module), name) not in seen_refs:
                seen_refs.add((id(module), name))
                plan.refs.append((module, name))
        for child_name, child in module._modules.items():
            if child is None:
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
    if policy is not None and len(units) == 1 and not wants_unit(root):
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
    def chain(index: int) -> list[int]:
        out = [index]
        while units[out[-1]].parent is not None:
            out.append(units[out[-1]].parent)
        return out

    chains = [chain(i) for i in sorted(members)]
    common = set(chains[0]).intersection(*map(set, chains[1:]))
    return next(i for i in chains[0] if i in common)


def _describe(policy: Policy) -> str:
    if isinstance(policy, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in policy)) + "}"
    return repr(policy)
