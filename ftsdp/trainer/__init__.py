"""ftsdp.trainer: the training job ``python -m ftsdp.train`` runs (docs/training.md)."""

import warnings
from typing import Any

from ftsdp.trainer._config import TrainConfig, parse_args

__all__ = ["TrainConfig", "parse_args"]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointManager", "ResumeInfo"):  # here before ftsdp.checkpoint (CHANGELOG.md)
        warnings.warn(
            f"ftsdp.trainer.{name} moved: use `from ftsdp.checkpoint import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        import ftsdp.checkpoint

        return getattr(ftsdp.checkpoint, name)
    raise AttributeError(f"module 'ftsdp.trainer' has no attribute {name!r}")
