"""torchrun for ``ftsdp.train`` with workers forked from a ``forkserver`` that imported
:data:`PRELOAD` (only imports: forking it is safe), so a restarted worker starts without importing
(docs/elastic.md, "Recovery time"); ``python -m ftsdp.launch [torchrun's flags] -- [its flags]``."""

from __future__ import annotations

import functools
import importlib.util
import ipaddress
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
import threading
import typing
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
_LOCAL_ADDR_FLAGS = ("--local-addr", "--local_addr")
_FORKSERVER_FLAW = (
    "the forkserver of CPython 3.10.0-3.10.8 and 3.11.0 accepts any local user's connection "
    "(CVE-2022-42919)"
)


def forkserver_is_safe(version: Sequence[int] | None = None) -> bool:
    """False on CPython releases whose forkserver any local user reaches (CVE-2022-42919)."""
    major, minor, micro = (int(v) for v in (version or sys.version_info)[:3])
    flawed = ((major, minor) == (3, 10) and micro < 9) or (major, minor, micro) == (3, 11, 0)
    return sys.implementation.name != "cpython" or not flawed


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``[torchrun flags] -- [ftsdp.train flags]`` -> the two lists; ``ValueError`` for a
    torchrun flag choosing another program."""
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
    """torchrun's command line running ``ftsdp/train.py`` in forked workers (spawned where the
    forkserver is unsafe; ``ValueError`` for an explicit forkserver there)."""
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
    if "--standalone" in ours and _flag_value(ours, _LOCAL_ADDR_FLAGS) is None:
        start.append("--local-addr=127.0.0.1")  # one node: the workers' store on loopback only
    return [*ours, *start, "--run-path", spec.origin, *train]


def start_method(ours: Sequence[str]) -> str | None:
    """The start method the caller chose (flag, or torchrun's ``PET_START_METHOD``), or None."""
    return _flag_value(ours, _START_FLAGS) or os.environ.get("PET_START_METHOD") or None


def _flag_value(argv: Sequence[str], names: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


def listen_address(host: str) -> str | None:
    """The one address a store named ``host`` may listen on: ``host`` when it is an IP address,
    127.0.0.1 for localhost; None for another name (its address may differ between machines)."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def bound_store(make: typing.Callable[..., typing.Any]) -> typing.Callable[..., typing.Any]:
    """``make`` (``TCPStore``'s signature) whose server listens only on its host's
    :func:`listen_address` (torch's rendezvous never passes ``master_listen_fd``)."""

    @functools.wraps(make)
    def store(
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        *args: typing.Any,
        **kw: typing.Any,
    ) -> typing.Any:
        address = listen_address(host_name)
        if not is_master or address is None or kw.get("master_listen_fd") is not None:
            return make(host_name, port, world_size, is_master, *args, **kw)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            sock = socket.create_server((address, port), family=family, backlog=4096)
        except OSError as e:  # torch's rendezvous then joins the store as a client
            raise RuntimeError(f"the c10d store cannot listen on {address}:{port}: {e}") from None
        fd = sock.detach()  # the store owns it from here
        try:
            return make(host_name, port, world_size, is_master, *args, master_listen_fd=fd, **kw)
        except BaseException:
            os.close(fd)
            raise

    return store


def bind_rendezvous_stores() -> None:
    """Make the stores torch's agent hosts listen only on their own address, where
    :func:`listen_address` names one (docs/cli.md, "On a shared machine")."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        c10d_rendezvous_backend,
        dynamic_rendezvous,
        static_tcp_rendezvous,
    )

    for module in (c10d_rendezvous_backend, static_tcp_rendezvous):
        if hasattr(module, "TCPStore"):
            setattr(module, "TCPStore", bound_store(dist.TCPStore))  # noqa: B010 (mypy)
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    if hasattr(handler, "_create_tcp_store_server"):

        def create(self: typing.Any, master_addr: str, master_port: int) -> typing.Any:
            return bound_store(dist.TCPStore)(
                master_addr, master_port, is_master=True, multi_tenant=True
            )

        setattr(handler, "_create_tcp_store_server", create)  # noqa: B010 (mypy)


def publish_store_every_round() -> None:
    """Make rank 0's agent publish the workers' store address in every rendezvous round, not
    only in the first (an agent joining a later round waited for it until the job ended;
    docs/elastic.md, "Limits")."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    rendezvous = handler.next_rendezvous
    if getattr(rendezvous, "publishes_every_round", False):
        return

    def next_rendezvous(self: typing.Any) -> typing.Any:
        info = rendezvous(self)
        shared = getattr(info, "bootstrap_store_info", None)
        if info.rank == 0 and shared is not None:  # (the round's store: keys of this round)
            info.store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, shared.master_addr)
            info.store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(shared.master_port))
        return info

    next_rendezvous.publishes_every_round = True  # type: ignore[attr-defined]
    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def release_finished_workers() -> None:
    """Let the agent's shutdown free the workers that finished: a forked worker whose function
    returned waits for the agent to read its result, which an agent stopping (SIGTERM) never
    does, so it was killed only at the end of the agent's 30 s wait."""
    from torch.distributed.elastic.multiprocessing import api

    context = api.MultiprocessContext
    close = context._close
    if getattr(close, "releases_workers", False):
        return

    def _close(self: typing.Any, death_sig: typing.Any, timeout: int = 30) -> None:
        finished = getattr(self, "_worker_finished_event", None)
        if finished is not None:  # no result is read any more
            # On a thread that is not waited for: a multiprocessing Event's set() waits for
            # every worker that was waiting on it to acknowledge, and a worker stopped meanwhile
            # (torch stops the others when one fails) never does; it kept the agent forever.
            threading.Thread(target=finished.set, name="ftsdp-release", daemon=True).start()
        close(self, death_sig, timeout)

    _close.releases_workers = True  # type: ignore[attr-defined]
    context._close = _close  # type: ignore[method-assign]


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
    sys.argv[0] = "python -m ftsdp.launch"  # torchrun's usage lines name the program by it
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
    bind_rendezvous_stores()
    publish_store_every_round()
    release_finished_workers()
    torchrun.main(command)


if __name__ == "__main__":
    main()
