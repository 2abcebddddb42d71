"""The checkpoint exception hierarchy: what state a checkpoint is in, mapped to built-ins."""


class CheckpointError(Exception):
    """Base class of every error about a checkpoint's contents or state."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The root does not exist, holds no committed step, or the requested step is not committed."""


class IncompleteCheckpointError(CheckpointError):
    """A committed manifest lists an object that is missing or has the wrong size."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Bytes or metadata that fail validation: checksum mismatch, malformed or unsafe manifest."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A pickle names something other than its format's plain data (unpickling it could run
    code); ``trust_pickle=True`` (``--trust-pickle``) opens it: only for checkpoints you trust."""


class NewerFormatError(CheckpointError):
    """The manifest was written by a newer format version than this code reads."""


class StateMismatchError(CheckpointError, ValueError):
    """The target state and the checkpoint disagree: missing/unexpected keys, shape or dtype."""
