"""Public names of a package loaded on first use, and names that moved, still resolved with a
DeprecationWarning. The rooms (``catalog``, ``saving``, ...) import one another's private modules,
so a room's ``__init__`` imports none of its own: importing ``format._regular`` must not run
``saving``'s modules through ``saving/__init__.py`` (tests/unit/test_layout.py, no cycles)."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, modules: Mapping[str, tuple[str, ...]], moved: Mapping[str, str] | None = None
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``: ``modules`` maps a module
    (relative to ``package``: ``"_checks"``) to the public names it defines; ``moved`` maps an
    old name to the package that exports it now (resolved with a DeprecationWarning, not in
    ``__all__`` or ``dir()``)."""
    exports = {name: module for module, names in modules.items() for name in names}
    moved = moved or {}

    def __getattr__(name: str) -> Any:
        if name in exports:
            module = exports[name]
            if not module.startswith("ftsdp."):
                module = f"{package}.{module}"
            value = getattr(importlib.import_module(module), name)
            setattr(sys.modules[package], name, value)  # later lookups skip this function
            return value
        if name in moved:
            warnings.warn(
                f"{package}.{name} moved: use `from {moved[name]} import {name}`",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        # Not a name: ``from package import _module`` falls back to importing the submodule.
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return sorted(exports), __getattr__, __dir__
