"""``python -m ftsdp.launch``'s command line: torchrun's flags before ``--``, ftsdp.train's after
it, turned into torchrun's own command line (``--run-path`` to ftsdp/train.py, forkserver unless
the caller chose a start method). Its jobs run in tests/e2e/test_faults.py (job A)."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest

import ftsdp.train
from ftsdp import launch
from ftsdp.testing import _spawn


def test_flags_before_the_separator_are_torchruns_and_after_it_the_trainings() -> None:
    ours, train = launch.split_argv(["--nproc-per-node=2", "--", "--steps", "10", "--", "x"])
    assert (ours, train) == (["--nproc-per-node=2"], ["--steps", "10", "--", "x"])
    assert launch.split_argv(["--standalone"]) == (["--standalone"], [])


@pytest.mark.parametrize("flag", ["-m", "--module", "--no-python", "--run-path", "--run_path=1"])
def test_flags_that_choose_another_program_are_refused(flag: str) -> None:
    with pytest.raises(ValueError, match="always runs ftsdp.train"):
        launch.split_argv(["--standalone", flag, "--", "--steps", "3"])


def test_torchrun_runs_the_entry_file_in_forked_workers(monkeypatch) -> None:
    monkeypatch.delenv("PET_START_METHOD", raising=False)
    cmd = launch.torchrun_argv(["--standalone"], ["--steps", "3"])
    assert cmd == [
        "--standalone",
        "--start-method=forkserver",
        "--local-addr=127.0.0.1",  # one node: the workers' store listens on loopback only
        "--run-path",
        ftsdp.train.__file__,
        "--steps",
        "3",
    ]
    for chosen in (["--start-method", "spawn"], ["--start_method=fork"]):
        cmd = launch.torchrun_argv(chosen, [])
        assert cmd[: len(chosen)] == chosen and "--start-method=forkserver" not in cmd
        assert launch.start_method(chosen) in ("spawn", "fork")
    monkeypatch.setenv("PET_START_METHOD", "spawn")  # torchrun reads its flags from PET_* too
    assert launch.start_method([]) == "spawn"
    assert "--start-method=forkserver" not in launch.torchrun_argv([], [])


def test_a_bad_command_line_is_one_line_and_status_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc-per-node=2", "-m", "ftsdp.train"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ftsdp.launch: error: -m: ftsdp.launch always runs ftsdp.train")


def test_the_agent_logs_a_workers_failure_without_importing_torch_dynamo() -> None:
    """torch's log formatter imports torch._dynamo to format an exception (1.5-4 s of the
    agent's time at the first worker failure); with the launcher's filter on torch's handlers
    the same traceback is printed and nothing is imported. A fresh interpreter, as the agent
    (without the filter the same program prints True: 4 s more, so not run here)."""
    code = (
        "import logging, sys\n"
        "from torch.distributed import run\n"
        "from ftsdp.launch import plain_tracebacks\n"
        "if sys.argv[1] == 'filtered':\n"
        "    plain_tracebacks('torch', 'torch.distributed')\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    logging.getLogger('torch.distributed.elastic.x').exception('failed (exitcode: 1)')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "filtered"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    lines = out.stderr.splitlines()
    assert lines[0].endswith("] failed (exitcode: 1)"), out.stderr
    assert "Traceback (most recent call last):" in lines[1], out.stderr
    assert lines[-1].endswith("] ZeroDivisionError: division by zero"), out.stderr


@pytest.mark.parametrize(
    ("version", "safe"),
    [
        *(((3, 10, 0), False), ((3, 10, 8), False), ((3, 11, 0), False), ((3, 10, 9), True)),
        *(((3, 11, 1), True), ((3, 12, 0), True), ((3, 13, 2), True)),
    ],
)
def test_the_forkserver_is_used_only_where_other_users_cannot_reach_it(
    monkeypatch, version, safe
) -> None:
    """CVE-2022-42919: on CPython 3.10.0-3.10.8 and 3.11.0 any local user can connect to the
    forkserver's socket and run code as the job. There the launcher spawns its workers, and an
    explicit forkserver is refused with one line. The tests' rank spawner spawns there too."""
    monkeypatch.delenv("PET_START_METHOD", raising=False)
    monkeypatch.setattr(sys, "version_info", (*version, "final", 0))
    assert launch.forkserver_is_safe() is safe
    assert _spawn.forkserver_flawed() is not safe  # run_ranks' own check for the tests' ranks
    cmd = launch.torchrun_argv(["--standalone"], [])
    assert launch.start_method(cmd) == ("forkserver" if safe else "spawn")
    if safe:
        return
    with pytest.raises(ValueError, match="CVE-2022-42919.*--start-method=spawn"):
        launch.torchrun_argv(["--start-method=forkserver"], [])
    assert launch.start_method(launch.torchrun_argv(["--start-method=fork"], [])) == "fork"


def _listening_on(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_the_stores_the_launcher_hosts_listen_only_on_their_own_address(monkeypatch) -> None:
    """torch's c10d store listens on every interface whatever its host name (reference: a plain
    TCPStore); under ftsdp.launch the rendezvous store and the workers' store listen on their
    address only, when it is an IP address or localhost (--standalone's)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    loopback = "0100007F"
    plain = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    assert _listening_on(plain.port) - {loopback}, "torch's own store listens beyond loopback"
    monkeypatch.setattr(backend, "TCPStore", backend.TCPStore)  # restored after the test
    monkeypatch.setattr(static, "TCPStore", static.TCPStore)
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    monkeypatch.setattr(handler, "_create_tcp_store_server", handler._create_tcp_store_server)
    launch.bind_rendezvous_stores()
    params = RendezvousParameters("c10d", "localhost:0", "run1", 1, 1, is_host=True)
    rendezvous = backend._create_tcp_store(params)
    assert _listening_on(rendezvous.port) == {loopback}
    workers = handler._create_tcp_store_server(None, "127.0.0.1", 0)
    assert _listening_on(workers.port) == {loopback}
    fixed = static.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), multi_tenant=True)
    assert _listening_on(fixed.port) == {loopback}  # --rdzv-backend=static --master-addr=...
    assert [launch.listen_address(h) for h in ("localhost", "10.0.0.7", "[::1]", "node7")] == [
        "127.0.0.1",
        "10.0.0.7",
        "::1",
        None,  # a name may resolve differently on each node: torch's store, unchanged
    ]
    client = backend.TCPStore("127.0.0.1", rendezvous.port, is_master=False)
    client.set("k", "v")
    assert rendezvous.get("k") == b"v"


def test_the_agents_shutdown_frees_the_workers_that_finished(monkeypatch) -> None:
    """A forked worker whose function returned waits on the context's finished event; closing
    the context (the agent stopping) sets it first, so such a worker exits at once instead of
    being killed after the close's timeout (the e2e SIGTERM test runs the whole job)."""
    import signal
    import threading

    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.setattr(api.MultiprocessContext, "_close", api.MultiprocessContext._close)
    launch.release_finished_workers()
    launch.release_finished_workers()  # once only: not wrapped twice
    assert getattr(api.MultiprocessContext._close, "releases_workers", False)
    context = api.MultiprocessContext.__new__(api.MultiprocessContext)
    context._pc = None  # no processes: torch's close returns at once
    context._worker_finished_event = threading.Event()
    context._close(signal.SIGTERM, timeout=0)
    assert context._worker_finished_event.wait(10)  # set on a thread of its own


def _wait_on(event) -> None:
    event.wait()


def test_a_worker_stopped_while_waiting_does_not_keep_the_agent(monkeypatch) -> None:
    """A multiprocessing Event's ``set`` waits for each process waiting on it to wake, and one
    stopped meanwhile (torch stops the other workers when one fails: a worker that had finished
    first was waiting) never does. The agent's close hung there for good; it returns at once
    now. With every waiter alive, the close frees them all."""
    import multiprocessing
    import signal
    import time

    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.setattr(api.MultiprocessContext, "_close", api.MultiprocessContext._close)
    launch.release_finished_workers()
    ctx = multiprocessing.get_context("spawn")

    def close_with_waiters(stop_one: bool) -> tuple[float, list]:
        event = ctx.Event()
        waiters = [ctx.Process(target=_wait_on, args=(event,)) for _ in range(2)]
        for p in waiters:
            p.start()
        try:
            deadline = time.monotonic() + 60
            while event._cond._sleeping_count.get_value() < 2:  # both are waiting
                assert time.monotonic() < deadline
                time.sleep(0.05)
            if stop_one:
                waiters[0].kill()
                waiters[0].join()
            context = api.MultiprocessContext.__new__(api.MultiprocessContext)
            context._pc = None
            context._worker_finished_event = event
            start = time.monotonic()
            context._close(signal.SIGTERM, timeout=0)
            took = time.monotonic() - start
            if not stop_one:
                for p in waiters:
                    p.join(30)
            return took, [p.exitcode for p in waiters]
        finally:
            for p in waiters:
                p.kill()
                p.join()

    took, codes = close_with_waiters(stop_one=False)
    assert took < 5 and codes == [0, 0]  # both woken by the event
    took, codes = close_with_waiters(stop_one=True)
    assert took < 5 and codes[0] == -signal.SIGKILL


def test_rank_0_publishes_the_workers_store_in_every_round(monkeypatch) -> None:
    """torch publishes the shared store's address only in the round where rank 0's agent made
    it; an agent joining a later round (a lost node back) waited for it until the job died.
    Under ftsdp.launch rank 0 writes it into each round's store; other ranks write nothing."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    shared = RendezvousStoreInfo("10.0.0.7", 29511)  # made in an earlier round, kept by torch

    class Agent:  # a handler past its first round: torch's next_rendezvous returns the cached info
        def __init__(self, rank: int) -> None:
            self.rank, self.store = rank, dist.HashStore()  # the round's store, empty
            self.store.set_timeout(datetime.timedelta(seconds=2))  # a missing key: an error

    def cached(self: Agent) -> RendezvousInfo:
        return RendezvousInfo(self.store, self.rank, 2, shared)

    monkeypatch.setattr(handler, "next_rendezvous", cached)
    launch.publish_store_every_round()
    launch.publish_store_every_round()  # once only: not wrapped twice
    first, other = Agent(0), Agent(1)
    info = handler.next_rendezvous(first)
    assert info.rank == 0 and info.bootstrap_store_info is shared
    assert first.store.get("MASTER_ADDR") == b"10.0.0.7"
    assert first.store.get("MASTER_PORT") == b"29511"
    handler.next_rendezvous(other)
    assert other.store.num_keys() == 0
