"""ftsdp.trainer: what composes the engine, the rank manager and storage into a training job.

- :class:`CheckpointManager` saves and resumes a wrapped model, its optimizer and the caller's
  state at any world size (``_checkpoint``, ``_checkpoint_state``).
- :class:`TrainConfig` and ``parse_args`` are the training entry's flags (``_config``); the
  worker's runtime (rank manager, logs, signals, watchdog, ledger) is the ``Session``
  (``_session``), what a run works on is the ``Job`` made by ``build`` (``_job``), and ``run``
  is the step loop (``_loop``); ``python -m ftsdp.train`` runs them.
- ``_hooks``: the step hook the loop calls at its step boundaries (nothing by default; the
  fault suite's hook from ``ftsdp.testing`` when ``FTSDP_FAULT`` is set).
- ``ftsdp.examples.gpt`` (a small GPT) and ``ftsdp.examples.data`` (a synthetic language) are the
  example the main job trains.
"""

from ftsdp.checkpoint._manager import CheckpointManager, ResumeInfo
from ftsdp.trainer._config import TrainConfig, parse_args

__all__ = ["CheckpointManager", "ResumeInfo", "TrainConfig", "parse_args"]
