"""The main job: train a model on data with the ftsdp FSDP engine, elastically. By default a
small GPT on a synthetic language; ``--model hf:DIR`` / ``py:MODULE:FUNCTION`` and
``--data FILE.bin`` / a text file train yours (docs/training.md).

    torchrun --standalone --nproc-per-node=2 -m ftsdp.train [--steps N --global-batch B ...]
    torchrun --standalone --nproc-per-node=2 -m ftsdp.train --model hf:./my-config \
        --data train.bin --block-size 256 --config run.toml
    torchrun --nnodes=1:2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --max-restarts=3 \\
        -m ftsdp.train --checkpoint-url s3://bucket/run --deterministic
    python -m ftsdp.train            # one process, world size 1
    ftsdp-train --help               # every flag, generated from TrainConfig

parse -> build -> run -> close; the logic lives in ``ftsdp.trainer._config`` (flags, validation),
``ftsdp.trainer._session`` (the worker's runtime), ``ftsdp.trainer._job`` (model, optimizer,
data, CheckpointManager) and ``ftsdp.trainer._loop`` (the step loop, logs). See docs/elastic.md.
A user error (:class:`~ftsdp.trainer._errors.JobError`: a missing data file, a model that does not
fit the data, another run's checkpoint) is one line on stderr and exit status 2, no traceback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from ftsdp.trainer._config import parse_args
from ftsdp.trainer._errors import JobError
from ftsdp.trainer._hooks import HookFactory
from ftsdp.trainer._job import build
from ftsdp.trainer._loop import run
from ftsdp.trainer._session import Session


def fault_hook() -> HookFactory | None:
    """The fault suite's step hook when ``FTSDP_FAULT`` is set, else None (no hook).

    The one place product code imports ``ftsdp.testing`` (docs/design.md, "Import rules")."""
    if not os.environ.get("FTSDP_FAULT"):
        return None
    from ftsdp.testing import fault_hook_from_env

    return fault_hook_from_env


logger = logging.getLogger("ftsdp.train")

EXIT_USER_ERROR = 2  # as argparse's usage errors


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    with Session.open(cfg, hook=fault_hook()) as session:  # closed (in reverse) on the way out
        try:
            job = build(cfg, session)
            return run(cfg, session, job)
        except JobError as e:  # the user's to fix: one line, no traceback
            session.log.event({"event": "error", "error": f"JobError: {e}"[:2000]})
            if e.report:
                logger.error("error: %s", e)  # the console prefix names the logger and rank
            return EXIT_USER_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
