"""torchrun for ``ftsdp.train`` with preloaded workers: a restarted worker starts without importing.

    python -m ftsdp.launch --standalone --nproc-per-node=2 --max-restarts=3 -- \\
        --checkpoint-url ./checkpoints/run1 --checkpoint-every 20

Everything before ``--`` is torchrun's (``python -m torch.distributed.run --help``: rendezvous,
``--nnodes``, ``--max-restarts``, ``--monitor-interval``, ...); everything after it is
``ftsdp.train``'s. The same agent runs (torch's elastic agent, in this process): only the way it
starts workers differs. See [Note: preloaded workers].

[Note: preloaded workers]
A worker started by ``torchrun -m ftsdp.train`` is a new interpreter that imports torch,
torch._dynamo (torch.optim imports it) and ftsdp before it can join its group: 2.5-7 s of the 3-10 s
from a worker's kill -9 to the group's first new step on a 2-core machine, depending on its load
(docs/elastic.md, "Recovery time"). Here the agent starts its workers with the ``forkserver`` start
method (torchrun's ``--start-method``, with ``--run-path`` so the training entry runs as a function
in the worker): one server process, started at once, imports ``ftsdp.train`` once (:data:`PRELOAD`),
and every worker, first or restarted, is a fork of it. The server only imports (no Python thread, no
process group, no CUDA initialised), so forking it is safe; each worker runs ``ftsdp/train.py`` as
its main program and finds its imports done. The entry first freezes the objects it finds
(``gc.freeze()``, [Note: a worker's imports] in ``ftsdp/train.py``), so the worker's collections
neither walk nor copy the server's pages (without it, the first collection of a forked worker cost
0.5 s).

The agent learns of a failed worker by an exception that it logs (with function workers), and
torch's log formatter imports torch._dynamo to format an exception: 1.5-4 s of the agent's time
on the recovery path, measured. The launcher's agent formats those tracebacks itself, with the
standard library's formatter, before torch's handlers see the record (:class:`PlainTracebacks`),
so the formatter has nothing to import for. (Importing torch._dynamo in the agent up front costs
its start 2-4 s; from a background thread it is not safe: torch's modules must not be imported
from two threads at once, and doing so aborted the agent.)

What changes for the job: the workers' parent process is the fork server, not the agent (the
agent still watches, signals and restarts them; the fault suite's faults that signal the agent,
``term:target=agent`` and ``kill_node``, need ``torchrun -m ftsdp.train``), and the server keeps
one more interpreter with torch imported per agent. Code changed after the server started is not
seen by workers until the agent is restarted. ``--start-method`` may still be given (``spawn``
gives torchrun's behaviour back).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Sequence

USAGE = (
    "usage: python -m ftsdp.launch [torchrun's flags] -- [ftsdp.train's flags]\n\n"
    "torchrun's elastic agent over ftsdp.train, with workers forked from a process that did "
    "their imports (docs/elastic.md, 'Recovery time'). torchrun's flags:\n"
)
PRELOAD = ["ftsdp.train"]  # what the fork server imports once (torch and torch._dynamo with it)
# torchrun flags that choose what runs: this launcher always runs ftsdp.train.
_SCRIPT_FLAGS = ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path")
_START_FLAGS = ("--start-method", "--start_method")


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
    """torchrun's command line that runs ``ftsdp/train.py`` in forked workers."""
    spec = importlib.util.find_spec("ftsdp.train")
    if spec is None or spec.origin is None:
        raise RuntimeError("ftsdp.train is not importable: is ftsdp installed?")
    start: list[str] = []
    if start_method(ours) is None:
        start = ["--start-method=forkserver"]
    return [*ours, *start, "--run-path", spec.origin, *train]


def start_method(ours: Sequence[str]) -> str | None:
    """The start method the caller chose (flag, or torchrun's ``PET_START_METHOD``), or None."""
    for i, arg in enumerate(ours):
        name, eq, value = arg.partition("=")
        if name in _START_FLAGS:
            return value if eq else (ours[i + 1] if i + 1 < len(ours) else None)
    return os.environ.get("PET_START_METHOD") or None


class PlainTracebacks(logging.Filter):
    """A handler filter that renders a record's exception into its message with the standard
    library's formatter and drops ``exc_info``: torch's formatter would import torch._dynamo to
    format it (see the module note). The text is the same traceback either way."""

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
    """Run torchrun's agent over ``ftsdp.train`` with preloaded workers (see the module note)."""
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
    if start_method(ours) in (None, "forkserver"):
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()  # preloads while this process imports
    from torch.distributed import run as torchrun

    plain_tracebacks("torch", "torch.distributed")  # the handlers torch's import installed
    torchrun.main(command)


if __name__ == "__main__":
    main()
