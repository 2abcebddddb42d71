"""torch FSDP's wrap policies, for ``from ftsdp.fsdp.wrap import ...``.

``torch.distributed.fsdp.wrap`` becomes ``ftsdp.fsdp.wrap``: these are torch's own policy
objects (importing this module imports torch's FSDP), which ``ftsdp.FSDP(auto_wrap_policy=...)``
turns into units: the modules torch would wrap (see [Note: torch wrap policies] in
``_wrap.py``). ``enable_wrap`` / ``wrap`` (manual nested wrapping) are not here: ftsdp has one
wrapper per model, so pick the units with ``auto_wrap_policy`` instead.
"""

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
