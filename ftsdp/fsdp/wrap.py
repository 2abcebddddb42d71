"""torch FSDP's wrap policies (torch's own objects); no ``enable_wrap``/``wrap`` (docs/migrating.md)."""

from __future__ import annotations

from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
