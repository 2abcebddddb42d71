"""ftsdp.checkpoint: any job's state saved and resumed at any world size (docs/elastic.md)."""

from ftsdp.checkpoint._manager import CheckpointManager, ResumeInfo

__all__ = ["CheckpointManager", "ResumeInfo"]
