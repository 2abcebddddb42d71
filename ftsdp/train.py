"""The main job: train a model (a small GPT on a synthetic language by default) with the ftsdp
engine, elastically: ``torchrun ... -m ftsdp.train``, ``python -m ftsdp.launch``, or one process
(docs/training.md). A user error (``JobError``) is one line on stderr and exit status 2."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import time
from collections.abc import Sequence

from ftsdp.trainer._config import TrainConfig, parse_args  # imports no torch

# A bad command line: rank 0 reports it, the others wait this long first (torchrun stops them).
REPORT_WAIT_S = 30.0


def parse_or_exit(argv: Sequence[str] | None, rank: int) -> TrainConfig:
    """:func:`parse_args`; a bad command line (or config file) exits 2 with one line on stderr,
    from rank 0 (another rank only if the job was not stopped by then)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_args(argv)
    except SystemExit as e:
        if e.code:  # argparse wrote its usage, then the error on the last line
            if rank != 0:
                time.sleep(REPORT_WAIT_S)
            lines = err.getvalue().strip().splitlines()
            print(lines[-1] if lines else f"exit {e.code}", file=sys.stderr)
        raise


def _rank() -> int:
    """RANK, only to choose which rank reports a bad command line (0 when it is not an integer:
    the rank manager says what is wrong with it)."""
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0


if __name__ == "__main__":  # --help, --version and a bad command line answer before torch loads
    parse_or_exit(sys.argv[1:], _rank())

# The imports, timed for the phases record with the garbage collector paused; a program (not a
# library import) then freezes what they made (docs/elastic.md, "Recovery time").
_ENTRY = time.time()
_GC_WAS_ENABLED = gc.isenabled()
gc.disable()
try:
    import torch

    with contextlib.suppress(ImportError):  # a torch without it: nothing to import early
        import torch._dynamo  # noqa: F401
    _TORCH_IMPORTED = time.time()
    import logging

    from ftsdp.checkpoint import RootInUseError
    from ftsdp.elastic import LaunchEnvironmentError
    from ftsdp.trainer._errors import JobError
    from ftsdp.trainer._job import build, remember_lost_root
    from ftsdp.trainer._loop import run
    from ftsdp.trainer._phases import Phases, process_start_time
    from ftsdp.trainer._session import HookFactory, Session
finally:
    if __name__ == "__main__":  # a worker, not a library import: see above
        gc.freeze()
    if _GC_WAS_ENABLED:
        gc.enable()
_FTSDP_IMPORTED = time.time()


def fault_hook() -> HookFactory | None:
    """The fault suite's step hook when ``FTSDP_FAULT`` is set, else None; the one place product
    code imports ``ftsdp.testing`` (docs/design.md, "The map")."""
    if not os.environ.get("FTSDP_FAULT"):
        return None
    from ftsdp.testing import fault_hook_from_env

    return fault_hook_from_env


logger = logging.getLogger("ftsdp.train")

EXIT_USER_ERROR = 2  # as argparse's usage errors


def start_marks() -> Phases:
    """This process's start and the entry's import marks (taken when this module ran)."""
    phases = Phases()
    started = process_start_time()
    if started is not None:
        phases.mark("process_start", started)
    phases.mark("entry", _ENTRY)
    phases.mark("torch_imported", _TORCH_IMPORTED)
    phases.mark("ftsdp_imported", _FTSDP_IMPORTED)
    return phases


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_or_exit(argv, _rank())
    phases = start_marks()
    try:
        opened = Session.open(cfg, hook=fault_hook(), phases=phases)
    except LaunchEnvironmentError as e:  # one line, as a bad flag: not torchrun's doing
        print(f"ftsdp.train: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    with opened as session:
        try:
            job = build(cfg, session)
            phases.mark("built")
            return run(cfg, session, job)
        except (JobError, RootInUseError) as e:  # the user's to fix: one line, no traceback
            session.log.event({"event": "error", "error": f"{type(e).__name__}: {e}"[:2000]})
            # a JobError says whether this rank reports; every rank meets a root in use
            report = e.report if isinstance(e, JobError) else session.rm.rank == 0
            if isinstance(e, RootInUseError) and cfg.checkpoint_url:
                remember_lost_root(session.rm, cfg.checkpoint_url, e)
            if report:
                logger.error("error: %s", e)  # the console prefix names the logger and rank
            return EXIT_USER_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
