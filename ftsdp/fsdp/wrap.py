"""torch FSDP's wrap policies (torch's own objects). ``enable_wrap`` and ``wrap`` import, so that
scripts naming them load, and raise when called: ftsdp wraps with ``auto_wrap_policy`` only
(docs/migrating.md)."""

from __future__ import annotations

from typing import Any, NoReturn

from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    _module_wrap_policy,
    _or_policy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "_module_wrap_policy",
    "_or_policy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]


def _manual_wrapping(name: str) -> NoReturn:
    raise NotImplementedError(
        f"ftsdp.fsdp.wrap.{name}: manual nested wrapping is not supported; wrap the whole model "
        "once with FullyShardedDataParallel(model, auto_wrap_policy=...) (docs/migrating.md)"
    )


def enable_wrap(*args: Any, **kwargs: Any) -> NoReturn:
    """torch's manual-wrapping context: refused (use ``auto_wrap_policy``)."""
    _manual_wrapping("enable_wrap")


def wrap(*args: Any, **kwargs: Any) -> NoReturn:
    """torch's manual wrap of one module: refused (use ``auto_wrap_policy``)."""
    _manual_wrapping("wrap")
