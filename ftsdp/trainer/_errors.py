"""The training entry's user errors: one line and exit status 2 (docs/training.md)."""

from __future__ import annotations


class JobError(ValueError):
    """A user error of the training job (a flag, the model, the data, the checkpoint root).

    ``report``: whether this rank prints the line. When every rank meets the same error (a
    decision taken on rank 0 and broadcast, or the same bad flag everywhere) only rank 0 says
    it; a rank that met an error of its own always does.
    """

    def __init__(self, message: str, *, report: bool = True) -> None:
        super().__init__(message)
        self.report = report
