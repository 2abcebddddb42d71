"""torchrun for ``ftsdp.train`` with preloaded workers: a restarted worker starts without importing.

    python -m ftsdp.launch --standalone --nproc-per-node=2 --max-restarts=3 -- \\
        --checkpoint-url ./checkpoints/run1 --checkpoint-every 20

torch's elastic agent runs here and forks its workers from one ``forkserver`` that imported
:data:`PRELOAD` (only imports: no thread, process group or CUDA, so forking it is safe). Why and
what it changes for a job: docs/elastic.md, "Recovery time"."""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)

USAGE = (
    "usage: python -m ftsdp.launch [torchrun's flags] -- [ftsdp.train's flags]\n\n"
    "torchrun's elastic agent over ftsdp.train, with workers forked from a process that did "
    "their imports (docs/elastic.md, 'Recovery time'). torchrun's flags:\n"
)
PRELOAD = ["ftsdp.train"]  # what the fork server imports once (torch and torch._dynamo with it)
# torchrun flags that choose what runs: this launcher always runs ftsdp.train.
_SCRIPT_FLAGS = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
_START_FLAGS = ("--start-method", "--start_method")
_FORKSERVER_FLAW = (
    "the forkserver of CPython 3.10.0-3.10.8 and 3.11.0 accepts any local user's connection "
    "(CVE-2022-42919)"
)


def forkserver_is_safe(version: Sequence[int] | None = None) -> bool:
    """False on the CPython releases whose forkserver socket any local user can reach
    (CVE-2022-42919; ``version`` defaults to ``sys.version_info``)."""
    major, minor, micro = tuple(sys.version_info if version is None else version)[:3]
    flawed = ((major, minor) == (3, 10) and micro < 9) or (major, minor, micro) == (3, 11, 0)
    return sys.implementation.name != "cpython" or not flawed


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[torchrun flags] -- [ftsdp.train flags]`` -> the two lists (no ``--``: all torchrun's).

    Raises ``ValueError`` for a torchrun flag that would choose another program."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        ours, train = argv[:cut], argv[cut + 1 :]
    else:
        ours, train = argv, []
    for arg in ours:
        if arg.split("=", 1)[0] in _SCRIPT_FLAGS:
            raise ValueError(
                f"{arg}: ftsdp.launch always runs ftsdp.train; give torchrun's flags before "
                "-- and ftsdp.train's after it (python -m ftsdp.launch --nproc-per-node=2 -- "
                "--steps 100)"
            )
    return ours, train


def torchrun_argv(ours: Sequence[str], train: Sequence[str]) -> list[str]:
    """torchrun's command line that runs ``ftsdp/train.py`` in forked workers (spawned ones on a
    Python whose forkserver is unsafe, :func:`forkserver_is_safe`).

    Raises ``ValueError`` for an explicit forkserver on such a Python."""
    spec = importlib.util.find_spec("ftsdp.train")
    if spec is None or spec.origin is None:
        raise RuntimeError("ftsdp.train is not importable: is ftsdp installed?")
    start: list[str] = []
    chosen = start_method(ours)
    if chosen == "forkserver" and not forkserver_is_safe():
        raise ValueError(
            f"--start-method=forkserver: {_FORKSERVER_FLAW}; upgrade Python (3.10.9+, 3.11.1+) "
            "or use --start-method=spawn"
        )
    if chosen is None:
        if forkserver_is_safe():
            start = ["--start-method=forkserver"]
        else:  # spawn: each restarted worker imports again, but no socket for others to reach
            log.warning(
                "%s: workers start with spawn; upgrade Python for preloaded ones", _FORKSERVER_FLAW
            )
            start = ["--start-method=spawn"]
    return [*ours, *start, "--run-path", spec.origin, *train]


def start_method(ours: Sequence[str]) -> str | None:
    """The start method the caller chose (flag, or torchrun's ``PET_START_METHOD``), or None."""
    for i, arg in enumerate(ours):
        name, eq, value = arg.partition("=")
        if name in _START_FLAGS:
            return value if eq else (ours[i + 1] if i + 1 < len(ours) else None)
    return os.environ.get("PET_START_METHOD") or None


class PlainTracebacks(logging.Filter):
    """A handler filter rendering a record's exception into its message with the standard
    formatter (torch's would import torch._dynamo; docs/elastic.md, "Recovery time")."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.msg, record.args = f"{record.getMessage()}\n{record.exc_text}", None
            record.exc_info, record.exc_text = None, None
        return True


def plain_tracebacks(*loggers: str) -> None:
    """Install :class:`PlainTracebacks` on every handler of ``loggers`` (torch's, once imported)."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, PlainTracebacks) for f in handler.filters):
                handler.addFilter(PlainTracebacks())


def main(argv: Sequence[str] | None = None) -> None:
    """Run torchrun's agent over ``ftsdp.train`` with preloaded workers (module docstring)."""
    try:
        ours, train = split_argv(sys.argv[1:] if argv is None else argv)
        command = torchrun_argv(ours, train)
    except (ValueError, RuntimeError) as e:
        print(f"ftsdp.launch: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if "-h" in ours or "--help" in ours:
        print(USAGE)  # then torchrun's flags
        from torch.distributed import run as torchrun

        torchrun.main(["--help"])
    if start_method(command) == "forkserver":  # never on a flawed Python (torchrun_argv)
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()  # preloads while this process imports
    from ftsdp.train import parse_or_exit

    parse_or_exit(train, 0)  # a bad flag: one line and exit 2 here, not a failure torchrun retries
    from torch.distributed import run as torchrun

    plain_tracebacks("torch", "torch.distributed")  # the handlers torch's import installed
    torchrun.main(command)


if __name__ == "__main__":
    main()
