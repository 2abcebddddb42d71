"""The training entry's user errors: one line and exit status 2 (docs/training.md)."""

from __future__ import annotations


class JobError(ValueError):
    """A user error of the training job (a flag, the model, the data, the checkpoint root);
    ``report``: whether this rank prints the line (only rank 0 for an error every rank met)."""

    def __init__(self, message: str, *, report: bool = True) -> None:
        super().__init__(message)
        self.report = report
