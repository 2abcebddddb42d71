"""``--tensorboard DIR``: rank 0's metrics records as TensorBoard scalars (docs/report.md,
"TensorBoard"). Each record is flushed as it is written, so a SIGKILL loses nothing it logged."""

from __future__ import annotations

import logging
from typing import Any

from ftsdp.trainer._errors import JobError

logger = logging.getLogger(__name__)

TAGS: dict[str, dict[str, str]] = {
    "step": {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "perf/tokens_per_s",
        "s_per_step": "perf/s_per_step",
        "world_size": "elastic/world_size",
        "restarts": "elastic/restarts",
    },
    "checkpoint": {"blocking_s": "checkpoint/blocking_s"},
    "resume": {"seconds": "elastic/resume_s", "world_size": "elastic/world_size"},
}
INSTALL = "pip install 'ftsdp[tensorboard]' (or pip install tensorboard)"


class TensorBoardScalars:
    """A ``SummaryWriter`` fed with metrics records (:meth:`record`); :meth:`close` closes it."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def record(self, record: dict[str, Any]) -> None:
        """Write the record's scalars (see the module docstring); other records are ignored."""
        event, step, when = record.get("event", ""), record.get("step"), record.get("time")
        if not isinstance(step, int):
            return
        wrote = False
        for key, tag in TAGS.get(event, {}).items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), global_step=step, walltime=when)
                wrote = True
        if event == "preempted":
            self.writer.add_scalar("elastic/preempted", 1.0, global_step=step, walltime=when)
            wrote = True
        if wrote:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_tensorboard(logdir: str) -> TensorBoardScalars:
    """A writer into ``logdir``; :class:`JobError` naming the install if tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise JobError(f"--tensorboard {logdir} needs the tensorboard package: {INSTALL}") from None
    try:
        writer = SummaryWriter(log_dir=logdir)
    except OSError as e:
        raise JobError(f"--tensorboard {logdir}: cannot write there: {e.strerror or e}") from None
    logger.info("TensorBoard scalars in %s (tensorboard --logdir %s)", logdir, logdir)
    return TensorBoardScalars(writer)
