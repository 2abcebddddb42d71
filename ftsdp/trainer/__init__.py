"""ftsdp.trainer: what composes the engine, the rank manager and storage into a training job.

- :class:`TrainConfig` and ``parse_args`` are the training entry's flags (``_config``); the
  worker's runtime (rank manager, logs, signals, watchdog, ledger) is the ``Session``
  (``_session``), what a run works on is the ``Job`` made by ``build`` (``_job``), and ``run``
  is the step loop (``_loop``); ``python -m ftsdp.train`` runs them.
- ``_hooks``: the step hook the loop calls at its step boundaries (nothing by default; the
  fault suite's hook from ``ftsdp.testing`` when ``FTSDP_FAULT`` is set).
- ``ftsdp.examples.gpt`` (a small GPT) and ``ftsdp.examples.data`` (a synthetic language) are the
  example the main job trains; ``ftsdp.checkpoint`` the CheckpointManager it saves with.
"""

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
