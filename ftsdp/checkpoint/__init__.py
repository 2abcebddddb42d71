"""ftsdp.checkpoint: any job's state saved and resumed at any world size (docs/elastic.md)."""

from ftsdp.checkpoint._manager import CheckpointManager, ResumeInfo
from ftsdp.checkpoint._tiers import RootInUseError

__all__ = ["CheckpointManager", "ResumeInfo", "RootInUseError"]
