"""``ftsdp-ckpt``: inspect, verify, convert, reshard, diff and garbage-collect checkpoints
(docs/cli.md; exit codes: "Errors and exit codes"). The commands, and with them torch, are
imported once the command line parsed: ``--help`` and a usage error do not wait for torch."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import TextIO

from ftsdp.tools.ckpt._args import PROG, UsageError, parse, printable

# Errors that describe the input, not a bug here: one line and exit code 2 (and storage's
# CheckpointError, see _user_error).
USER_ERRORS = (UsageError, OSError, ValueError, KeyError)
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _one_line(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return printable(" ".join(str(text).split())) or type(error).__name__


def _user_error(error: BaseException) -> bool:
    storage = sys.modules.get("ftsdp.storage")  # not imported: none of its errors was raised
    return isinstance(error, USER_ERRORS) or (
        storage is not None and isinstance(error, storage.CheckpointError)
    )


def main(
    argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Run one command: parse -> build -> run -> close. Returns the exit code."""
    out, err = out or sys.stdout, err or sys.stderr
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        from ftsdp.tools.ckpt._commands import COMMANDS  # see the module docstring

        return COMMANDS[args.command](args, out)
    except KeyboardInterrupt:
        err.write(f"{PROG}: interrupted; nothing unfinished was committed\n")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`ftsdp-ckpt inspect URL | head`): stop quietly, as cat does.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    except Exception as e:
        if _user_error(e):
            err.write(f"{PROG}: error: {_one_line(e)}\n")
            return EXIT_USAGE
        # a bug here, not bad input: say so, and how to see the traceback
        if "--debug" in argv:
            traceback.print_exception(e, file=err)
        hint = "" if "--debug" in argv else "; rerun with --debug for the traceback"
        err.write(
            f"{PROG}: internal error: {type(e).__name__}: {_one_line(e)}{hint}. This is a bug "
            f"in {PROG}: please report it to the ftsdp maintainers with the command line and "
            "that traceback\n"
        )
        return EXIT_INTERNAL
