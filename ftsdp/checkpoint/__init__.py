"""ftsdp.checkpoint: save and resume any training job's state at any world size.

:class:`CheckpointManager` takes a model (ftsdp.FSDP, torch FSDP2, DDP or a plain module), its
optimizer and the caller's own state, saves them periodically through :mod:`ftsdp.storage`
(a durable root, and optionally a node-local memory tier), applies retention, and resumes from
the newest step either tier holds. It knows nothing of the training entry.
"""

from ftsdp.checkpoint._manager import CheckpointManager, ResumeInfo

__all__ = ["CheckpointManager", "ResumeInfo"]
