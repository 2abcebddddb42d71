"""ftsdp.checkpoint: save and resume any training job's state at any world size
(:class:`CheckpointManager`, docs/elastic.md); it knows nothing of the training entry."""

from ftsdp.checkpoint._manager import CheckpointManager, ResumeInfo

__all__ = ["CheckpointManager", "ResumeInfo"]
