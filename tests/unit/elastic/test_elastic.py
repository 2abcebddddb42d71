"""The rank manager's single-process pieces: torchrun environment, preemption signals, the
heartbeat watchdog (on an in-memory c10d store), fault specs, the fault hook and the
faulty filesystem."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from ftsdp import storage
from ftsdp.elastic import EXIT_STALL, PreemptionHandler, RankInfo, Watchdog, read_env
from ftsdp.testing import FaultHook, _faulty_fs, _hook, fault_hook_from_env, parse_faults
from ftsdp.testing._faults import fire, log_fault
from ftsdp.trainer._session import StepHook

pytestmark = pytest.mark.timeout(60)


# -- torchrun environment ------------------------------------------------------------------------


def test_read_env_parses_torchrun_variables() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job7",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    info = read_env(env)
    assert info == RankInfo(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        group_rank=1,
        restart_count=2,
        max_restarts=3,
        run_id="job7",
        master_addr="10.0.0.1",
        master_port=29500,
        torchrun=True,
    )


def test_read_env_without_torchrun_is_a_world_of_one() -> None:
    info = read_env({})
    assert (info.rank, info.world_size, info.local_world_size, info.torchrun) == (0, 1, 1, False)
    assert info.master_addr is None and info.run_id == "local"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "x"}, "RANK='x' must be an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR/MASTER_PORT are not set"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=3"),
    ],
)
def test_read_env_rejects_bad_values(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_env(env)


# -- preemption ---------------------------------------------------------------------------------


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_sigusr1_sets_the_flag_and_close_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    lines: list[str] = []
    with PreemptionHandler(grace_s=30, log=lines.append) as h:
        assert not h.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: h.requested)
        assert h.signal_name == "SIGUSR1" and h.received_at is not None
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing, kills nothing
        time.sleep(0.05)
        assert h.signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before
    assert len(lines) == 1 and "SIGUSR1 received" in lines[0]
    assert "saving at the next step boundary, exiting within 30s" in lines[0]


def test_a_signal_after_cannot_save_promises_no_save() -> None:
    """Once the loop has ended on an error there is no step boundary to save at: the signal's
    line says so (and why), and the grace period still bounds the exit."""
    lines: list[str] = []
    expired: list[str] = []
    h = PreemptionHandler(grace_s=0.3, log=lines.append, on_expired=expired.append).install()
    try:
        h.cannot_save("a peer process was lost")
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(lambda: expired, timeout=5)
    finally:
        h.close()
    assert len(lines) == 1 and "SIGTERM received" in lines[0], lines
    assert "nothing will be saved (a peer process was lost), exiting within 0.3s" in lines[0]
    assert "saving" not in lines[0]


def test_the_grace_period_expires_from_the_watcher_thread() -> None:
    expired: list[str] = []
    h = PreemptionHandler(grace_s=0.2, log=lambda _: None, on_expired=expired.append).install()
    try:
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert _wait_for(lambda: expired, timeout=5)
        assert 0.15 < time.monotonic() - t0 < 3
        assert "grace period of 0.2s exceeded (SIGTERM)" in expired[0]
    finally:
        h.close()


def test_arm_without_a_signal_and_close_cancels() -> None:
    expired: list[str] = []
    h = PreemptionHandler(grace_s=0.1, on_expired=expired.append).install()
    h.arm()
    assert _wait_for(lambda: expired)
    assert "peer preemption" in expired[0] and not h.requested
    h.close()
    h.close()  # idempotent
    h2 = PreemptionHandler(grace_s=0.2, on_expired=expired.append).install()
    h2.arm()
    h2.close()  # before the deadline: nothing fires
    time.sleep(0.4)
    assert len(expired) == 1
    with pytest.raises(ValueError, match="grace_s=0"):
        PreemptionHandler(grace_s=0)


# -- watchdog -----------------------------------------------------------------------------------


INTERVAL_S = 0.05  # the watchdogs' interval in these tests
LATE_S = 1.0  # how late a watchdog thread may wake on a loaded machine (2 cores, many tests)


def _pair(store, **kw):
    found: dict[int, list] = {0: [], 1: []}
    dogs = [
        Watchdog(
            store, r, 2, interval_s=INTERVAL_S, on_stall=found[r].extend, log=lambda _: None, **kw
        )
        for r in (0, 1)
    ]
    return dogs, found


def _check_staleness(stall, timeout_s: float, observer: int) -> None:
    """The stall's own staleness (the watcher's clock, from when it last saw the heartbeat
    change) passed the timeout, and by at most one interval plus a late wake-up: the watcher
    checks once per interval. A stall learnt from the shared alarm carries the watcher's figure
    written with 3 decimals, so it may read up to 0.5 ms below the watcher's."""
    rounding = 0.0 if stall.seen_by == observer else 0.0005
    assert timeout_s - rounding < stall.seconds <= timeout_s + INTERVAL_S + LATE_S, stall


def test_a_rank_that_stops_beating_is_named_within_the_bound() -> None:
    dogs, found = _pair(dist.HashStore(), heartbeat_timeout_s=0.5)
    for d in dogs:
        d.start()
    dogs[0].beat(4)
    dogs[1].beat(7)
    time.sleep(0.3)
    dogs[1]._stop.set()  # rank 1 freezes (as under SIGSTOP): no heartbeat, no "closed"
    dogs[1]._thread.join()
    assert _wait_for(lambda: found[0], timeout=5)
    (stall,) = found[0]
    assert (stall.rank, stall.step, stall.kind, stall.seen_by) == (1, 7, "heartbeat", 0)
    _check_staleness(stall, 0.5, observer=0)
    assert str(stall).startswith("rank 1 stalled for ")
    assert str(stall).endswith("its last heartbeat reported step 7")
    dogs[0].close()


def test_a_closed_rank_is_not_a_stall() -> None:
    dogs, found = _pair(dist.HashStore(), heartbeat_timeout_s=0.3)
    for d in dogs:
        d.start()
    time.sleep(0.2)
    dogs[1].close()
    time.sleep(0.8)
    assert found[0] == [] and dogs[0].error is None
    dogs[0].close()


def test_alive_ranks_without_progress_name_the_ones_behind() -> None:
    dogs, found = _pair(dist.HashStore(), heartbeat_timeout_s=5, progress_timeout_s=0.4)
    for d in dogs:
        d.start()
    dogs[0].beat(5)
    dogs[1].beat(3)  # rank 1 hangs at step 3 (alive: it keeps beating)
    assert _wait_for(lambda: found[0], timeout=5)
    assert [(s.rank, s.step, s.kind) for s in found[0]] == [(1, 3, "progress")]
    for d in dogs:
        d.close()


class _CountingClient:
    """One rank's view of a shared HashStore that counts the keys its calls touch."""

    def __init__(self, inner) -> None:
        self.inner, self.keys, self.beats = inner, 0, 0

    def __getattr__(self, name):
        def call(*args, **kwargs):
            if name == "set" and args[1] != b"closed":
                self.beats += 1
            if name not in ("wait", "check"):  # startup only, not per interval
                self.keys += len(args[0]) if name == "multi_get" else 1
            return getattr(self.inner, name)(*args, **kwargs)

        return call


def test_each_rank_touches_at_most_4_store_keys_per_heartbeat() -> None:
    """8 ranks' real watchdog threads on one store: at most 4 W keys per interval in all (a
    watchdog that reads every peer's key touches W + W² = 72 at W = 8)."""
    world, inner = 8, dist.HashStore()
    clients = [_CountingClient(inner) for _ in range(world)]
    found: list = []
    dogs = [
        Watchdog(c, r, world, interval_s=0.02, heartbeat_timeout_s=5, on_stall=found.extend)
        for r, c in enumerate(clients)
    ]
    for d in dogs:
        d.start()
    assert _wait_for(lambda: min(c.beats for c in clients) >= 6)
    for d in dogs:
        d._stop.set()
        d._thread.join()
    assert found == [] and all(d.error is None for d in dogs)
    per_beat = [c.keys / c.beats for c in clients]
    assert max(per_beat) <= 4, per_beat
    for d in dogs:
        d.close()


def test_every_rank_acts_on_a_stopped_rank_that_only_two_of_them_watch() -> None:
    world, stopped = 8, 5
    store = dist.HashStore()
    found: dict[int, list] = {r: [] for r in range(world)}
    dogs = [
        Watchdog(
            store,
            r,
            world,
            interval_s=INTERVAL_S,
            heartbeat_timeout_s=0.3,
            on_stall=found[r].extend,
        )
        for r in range(world)
    ]
    for d in dogs:
        d.start()
        d.beat(2)
    watchers = {r for r in range(world) if stopped in dogs[r].watching}
    assert len(watchers) == 2
    time.sleep(0.1)
    dogs[stopped]._stop.set()  # frozen: no heartbeat, no "closed"
    dogs[stopped]._thread.join()
    others = [r for r in range(world) if r != stopped]
    assert _wait_for(lambda: all(found[r] for r in others), timeout=5)
    for r in others:
        assert [(s.rank, s.step, s.kind) for s in found[r]] == [(stopped, 2, "heartbeat")]
        (stall,) = found[r]
        assert stall.seen_by in watchers, (r, stall)  # measured by a watcher, relayed to all
        _check_staleness(stall, 0.3, observer=r)
    for d in dogs:
        d.close()


class _DeadStore:
    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.dead = False

    def __getattr__(self, name):
        def call(*args, **kwargs):
            if self.dead:
                raise RuntimeError("connection refused")
            return getattr(self.inner, name)(*args, **kwargs)

        return call


def test_an_unreachable_store_and_a_peer_that_never_appears() -> None:
    store = _DeadStore()
    found: list = []
    w = Watchdog(store, 0, 1, interval_s=0.05, heartbeat_timeout_s=0.3, on_stall=found.extend)
    w.start()
    time.sleep(0.15)
    store.dead = True
    assert _wait_for(lambda: found)
    assert found[0].kind == "store" and "c10d store unreachable" in str(found[0])
    w.close()

    found.clear()
    lonely = Watchdog(
        dist.HashStore(), 0, 3, interval_s=0.05, heartbeat_timeout_s=0.3, on_stall=found.extend
    )
    lonely.start()
    assert _wait_for(lambda: found)
    assert sorted(s.rank for s in found) == [1, 2]
    lonely.close()
    with pytest.raises(ValueError, match="interval_s"):
        Watchdog(store, 0, 1, interval_s=1, heartbeat_timeout_s=1)


def test_the_watchdog_kills_a_stalled_local_peer_but_never_a_process_that_reused_its_pid() -> None:
    """The watchdog opens a pidfd of each local peer at start and signals through it: a stalled
    peer that is alive dies; once the peer has exited, the process that now holds its pid (a pid
    reused, simulated by pointing the peer's entry at a new child) survives the kill path."""
    import socket

    from ftsdp.elastic._watchdog import Stall

    host, me = socket.gethostname(), os.getpid()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    stalled = subprocess.Popen(sleep)
    exited = subprocess.Popen(sleep)
    store, log = dist.HashStore(), []
    peers = [(host, me), (host, stalled.pid), (host, exited.pid)]
    w = Watchdog(store, 0, 3, interval_s=0.05, heartbeat_timeout_s=0.3, peers=peers, log=log.append)
    exited.kill()
    exited.wait()
    newcomer = subprocess.Popen(sleep)
    try:
        w.peers[2] = (host, newcomer.pid)  # the pid the watchdog knew now names another process
        w._kill_local([Stall(1, 3, 1.0, "heartbeat"), Stall(2, 3, 1.0, "heartbeat")])
        assert stalled.wait(timeout=30) == -signal.SIGKILL
        time.sleep(0.2)
        assert newcomer.poll() is None, "the watchdog killed a process that reused a peer's pid"
        assert log == [f"ftsdp watchdog (rank 0): killed rank 1 (pid {stalled.pid})"]
    finally:
        w.close()
        for p in (stalled, newcomer):
            p.kill()
            p.wait()


def test_the_watchdog_checks_the_agent_first_in_every_interval() -> None:
    calls: list[float] = []
    w = Watchdog(
        dist.HashStore(), 0, 1, interval_s=INTERVAL_S, heartbeat_timeout_s=1.0,
        agent_check=lambda: calls.append(time.monotonic()),
    )  # fmt: skip
    w.start()
    assert _wait_for(lambda: len(calls) >= 4)
    w.close()
    assert w.error is None and w.stalls == []


# The agent runs the worker as torchrun does (Popen, a session of its own); the test's helper
# is a subreaper, so the orphaned worker is reparented to it and it reads the exit status.
_WORKER = """
import logging, os, sys, time, torch
if os.environ.get("NO_PIDFD"):
    del os.pidfd_open  # as on a kernel without pidfds: the parent is watched
from ftsdp.elastic import RankInfo, RankManager
from ftsdp.elastic._rank import Agent
logging.basicConfig(format="%(message)s")
rm = RankManager(info=RankInfo(), device=torch.device("cpu"), agent=Agent())
assert rm.agent.pid == os.getppid()
rm.exit_if_orphaned()  # the agent lives: nothing happens
print(os.getpid(), flush=True)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    rm.exit_if_orphaned()
    time.sleep(0.01)
"""
_AGENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
time.sleep(120)
"""
_REAPER = """
import ctypes, json, os, signal, subprocess, sys, time
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
agent = subprocess.Popen(
    [sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True
)
worker = int(agent.stdout.readline())
os.kill(agent.pid, signal.SIGKILL)
agent.wait()
start = time.monotonic()
_, status = os.waitpid(worker, 0)
print(json.dumps([worker, agent.pid, os.waitstatus_to_exitcode(status), time.monotonic() - start]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="a subreaper (prctl) is Linux only")
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "parent"])
def test_a_worker_whose_agent_is_killed_exits_with_one_line(tmp_path, pidfd: bool) -> None:
    env = {**os.environ, "NO_PIDFD": "" if pidfd else "1"}
    env.pop("TORCHELASTIC_RUN_ID", None)
    with open(tmp_path / "worker.err", "w") as err:
        out = subprocess.run(
            [sys.executable, "-c", *map(textwrap.dedent, (_REAPER, _AGENT, _WORKER))],
            stdout=subprocess.PIPE, stderr=err, env=env, text=True, timeout=50, check=True,
        ).stdout  # fmt: skip
    worker, agent, code, seconds = json.loads(out)
    assert code == EXIT_STALL and seconds < 5
    assert (tmp_path / "worker.err").read_text().splitlines() == [
        f"ftsdp (rank 0): the torchrun agent (pid {agent}) is gone: exiting with {EXIT_STALL}, "
        "committing nothing more"
    ]
    assert not os.path.exists(f"/proc/{worker}")


def test_the_orphan_check_may_be_asked_from_several_threads_at_once() -> None:
    """The commits of the durable tier and the memory tier run on threads of their own and
    both ask whether the agent is gone before committing: a poll object refuses a second
    poll() while one runs ("concurrent poll() invocation" failed a node-loss job once)."""
    from ftsdp.elastic._rank import Agent

    agent = Agent()  # this process's parent: alive
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            for _ in range(20_000):
                assert not agent.gone()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- fault specs --------------------------------------------------------------------------------


def test_fault_specs_parse_and_filter_by_rank_and_restart() -> None:
    faults = parse_faults(
        "kill:rank=1:step=7; term:step=5:target=agent;"
        "crash_in_save:point=after_data:n=2:step=4:restart=1;stop:step=3:restart=any"
    )
    assert [f.kind for f in faults] == ["kill", "term", "crash_in_save", "stop"]
    assert faults[1].when == "after_save" and faults[0].when == "before_save"
    assert faults[2].n == 2 and faults[2].restart == 1 and faults[3].restart is None
    kinds = lambda hook: [f.kind for f in hook.faults]  # noqa: E731
    assert kinds(FaultHook(faults, rank=1, restart_count=0)) == ["kill", "term", "stop"]
    assert kinds(FaultHook(faults, rank=0, restart_count=1)) == ["crash_in_save", "stop"]
    assert fault_hook_from_env(rank=0, restart_count=0, env={}).faults == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode:step=1", "unknown fault kind 'explode'"),
        ("kill:rank=1", "needs step=N"),
        ("kill:step", "must be key=value"),
        ("kill:step=1:colour=red", "unknown key 'colour'"),
        ("crash_in_save:step=1", "needs point="),
        ("term:step=1:target=moon", "target="),
        ("kill:step=1:when=never", "when="),
    ],
)
def test_bad_fault_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_faults(spec)


def test_the_fault_hook_is_the_trainers_step_hook_and_fires_at_its_boundary(
    tmp_path, monkeypatch
) -> None:
    fired = []
    monkeypatch.setattr(
        _hook, "fire", lambda f, rank, inc, agent: fired.append((f.kind, rank, inc))
    )
    spec = "kill:step=3; term:step=3:target=agent; crash_in_save:point=after_data:step=3"
    hook = fault_hook_from_env(
        rank=1, restart_count=0, incarnation="inc7", env={"FTSDP_FAULT": spec}
    )
    assert isinstance(hook, StepHook)
    hook.at_step_end(2)
    hook.after_save(2)
    assert fired == []
    hook.at_step_end(3)  # before_save: kill
    assert fired == [("kill", 1, "inc7")]
    hook.after_save(3)  # term defaults to after_save; crash_in_save never fires here
    assert fired == [("kill", 1, "inc7"), ("term", 1, "inc7")]
    local = str(tmp_path / "ck")
    assert hook.checkpoint_url(local) == f"faulty://{local}"  # crash_in_save applies
    assert (
        FaultHook(parse_faults("kill:step=3"), rank=1, restart_count=0).checkpoint_url(local)
        == local
    )


def test_a_fault_is_logged_with_its_incarnation_before_it_fires(tmp_path, monkeypatch) -> None:
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv("FTSDP_FAULT_LOG", str(log))
    (fault,) = parse_faults("exit:rank=1:step=4:code=3")
    log_fault(fault, 1, "inc7", path="x")
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["event"] == "fault" and record["kind"] == "exit" and record["step"] == 4
    assert record["rank"] == 1 and record["incarnation"] == "inc7" and record["path"] == "x"
    assert record["pid"] == os.getpid() and abs(record["time"] - time.time()) < 60
    with pytest.raises(ValueError, match="faulty://"):
        fire(parse_faults("crash_in_save:point=before_latest:step=1")[0], 0)


def test_fault_injection_is_logged_and_signals_only_a_torchrun_agent_or_the_launcher(
    tmp_path, monkeypatch, caplog
) -> None:
    """An armed FTSDP_FAULT is logged at start. kill_node and term:target=agent signal the agent,
    so they act only when the given agent is this process's parent running torchrun or
    ftsdp.launch: here (under pytest, whose parent is a shell or CI runner) they are refused and
    nothing is signalled; under a parent named torchrun the SIGTERM reaches it."""
    spec = "kill_node:step=2; term:step=3:target=agent"
    with caplog.at_level("WARNING", logger="ftsdp.testing"):
        hook = fault_hook_from_env(
            rank=0, restart_count=0, agent=os.getppid(), env={"FTSDP_FAULT": spec}
        )
    text = caplog.text
    assert "fault injection armed by FTSDP_FAULT='kill_node:step=2; term" in text
    assert "will be refused" in text
    assert fault_hook_from_env(rank=0, restart_count=0, env={}).faults == []
    killed: list = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    for agent in (None, os.getppid(), os.getpid()):
        for fault in parse_faults(spec):
            fire(fault, 0, "inc", agent)
    hook.agent = os.getppid()
    hook.at_step_end(2)
    hook.after_save(3)
    assert killed == [], "a fault signalled a process that is not the job's agent"
    assert "refusing fault kill_node at step 2 on rank 0" in caplog.text
    monkeypatch.undo()

    agent = tmp_path / "torchrun"  # an agent by name, the worker's parent, as torchrun is
    agent.write_text(
        textwrap.dedent(
            """
            import signal, subprocess, sys
            signal.signal(signal.SIGTERM, lambda *a: print("agent got SIGTERM", flush=True))
            worker = (
                "import os; from ftsdp.testing._faults import fire, parse_faults; "
                "fire(parse_faults('term:step=1:target=agent')[0], 0, 'inc', os.getppid())"
            )
            subprocess.run([sys.executable, "-c", worker], check=True)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(agent)], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout == "agent got SIGTERM\n", out.stderr


# -- the faulty filesystem ------------------------------------------------------------------------


class _Crash(BaseException):
    pass


@pytest.fixture
def crash_instead_of_exit(monkeypatch):
    def crash(fault, path):
        raise _Crash(f"{fault.point} {path}")

    monkeypatch.setattr(_faulty_fs, "_crash", crash)


def _state(value: float) -> dict:
    return {"w": torch.full((6,), value), "meta": {"step": int(value)}}


def test_faulty_fs_passes_through_when_nothing_fires(tmp_path) -> None:
    url = _faulty_fs.arm(
        str(tmp_path / "ck"), parse_faults("crash_in_save:point=before_manifest:step=99"), 0
    )
    assert url.startswith("faulty:///")
    storage.save(_state(1.0), url, step=1)
    storage.save(_state(2.0), url, step=2)
    assert storage.list_steps(url) == [1, 2] == storage.list_steps(str(tmp_path / "ck"))
    target = _state(0.0)
    storage.load(target, url, step=1)
    assert torch.equal(target["w"], torch.ones(6)) and target["meta"]["step"] == 1
    assert (tmp_path / "ck" / "latest").read_text() == "2\n"
    with pytest.raises(ValueError, match="local checkpoint directory"):
        _faulty_fs.arm("s3://bucket/x", [], 0)


@pytest.mark.parametrize("point", ["after_data", "before_manifest", "before_latest"])
def test_faulty_fs_crashes_at_each_point_of_the_commit(tmp_path, point, crash_instead_of_exit):
    root = tmp_path / "ck"
    url = _faulty_fs.arm(str(root), parse_faults(f"crash_in_save:point={point}:step=2"), 0)
    storage.save(_state(1.0), url, step=1)
    with warnings.catch_warnings(record=True), pytest.raises(_Crash, match=point):
        storage.save(_state(2.0), url, step=2)
    committed = storage.list_steps(str(root))
    data = [p.name for p in (root / "step-2").iterdir() if p.suffix == ".safetensors"]
    if point == "after_data":
        assert committed == [1] and len(data) == 1
    elif point == "before_manifest":
        assert committed == [1] and not (root / "step-2" / "manifest.json").exists()
    else:
        assert committed == [1, 2] and (root / "latest").read_text() == "1\n"
    for step in committed:  # every committed step stays readable
        target = _state(0.0)
        storage.load(target, str(root), step=step)
        assert torch.equal(target["w"], torch.full((6,), float(step)))
    assert json.loads((root / "step-1" / "manifest.json").read_text())["step"] == 1


# -- joining a fresh store namespace ---------------------------------------------------------------


def test_the_join_handshake_ignores_keys_left_by_a_previous_incarnation() -> None:
    import threading

    from ftsdp.elastic._rank import handshake

    store = dist.HashStore()
    for r in (1, 2):  # what the previous incarnation left behind
        store.set(f"req/{r}", "old-nonce")
        store.set(f"ack/{r}", "oldtoken old-nonce")
        store.set(f"ok/{r}", "oldtoken")
    tokens: dict[int, str] = {}

    def join(rank: int, delay: float) -> None:
        time.sleep(delay)
        tokens[rank] = handshake(store, rank, 3, timeout_s=10)

    # Rank 0 comes last, so the others see only stale answers for a while.
    threads = [threading.Thread(target=join, args=(r, d)) for r, d in ((1, 0), (2, 0.05), (0, 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert len(tokens) == 3 and len(set(tokens.values())) == 1
    assert tokens[0] != "oldtoken"
    with pytest.raises(TimeoutError, match="rank 0: no answer from ranks \\[1\\]"):
        handshake(dist.HashStore(), 0, 2, timeout_s=0.1)


# -- teardown: close() leaves nothing for the interpreter's exit -----------------------------------


def _named_thread(name: str, stop, busy: bool):
    """A thread whose OS name is ``name`` (as gloo names its workers): running or blocked.

    Running as a native worker does, without the GIL (hashlib drops it while it hashes): a
    thread spinning in Python would hold it, and every ``/proc`` file the waiter opens would
    then wait a switch interval (5 ms) for it, 1-3 s per wait in a process of 60 threads."""
    import ctypes
    import hashlib
    import threading

    def body() -> None:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
        data = bytes(4 << 20)
        while not stop.is_set():
            if busy:
                hashlib.sha256(data).digest()
            else:
                stop.wait()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")
def test_close_waits_for_busy_worker_threads_and_gives_up_at_its_bound() -> None:
    import threading

    from ftsdp.elastic._teardown import wait_for_idle_workers

    stop = threading.Event()
    idle_thread = _named_thread("ftsdp_idle", stop, busy=False)
    busy_thread = _named_thread("ftsdp_busy", stop, busy=True)
    # the threads a long job's process holds (the waiter reads every thread's state)
    others = [threading.Thread(target=stop.wait, daemon=True) for _ in range(60)]
    for t in others:
        t.start()
    try:
        time.sleep(0.05)
        idle, waited, busy = wait_for_idle_workers(timeout_s=5.0, names=("ftsdp_idle",))
        assert idle and busy == [] and waited < 1.0
        idle, waited, busy = wait_for_idle_workers(timeout_s=0.3, names=("ftsdp_busy",))
        assert not idle and waited >= 0.3 and len(busy) == 1 and "ftsdp_busy (R)" in busy[0]
        threading.Timer(0.2, stop.set).start()  # the work ends: the wait returns soon after
        idle, waited, busy = wait_for_idle_workers(timeout_s=5.0, names=("ftsdp_busy",))
        assert idle and 0.1 < waited < 3.0
    finally:
        stop.set()
        for t in [idle_thread, busy_thread, *others]:
            t.join(5)


def test_close_destroys_every_group_and_reports_the_ones_still_held() -> None:
    from ftsdp.elastic import CloseReport, RankManager

    rm = RankManager.init(device="cpu", timeout_s=30, env={})
    assert (rm.rank, rm.world_size, rm.local_rank) == (0, 1, 0)
    try:
        held = dist.new_group([0])  # as a model holds its groups past close()
        dropped = dist.new_group([0])
        del dropped
        dist.all_reduce(torch.ones(4), group=held)
        report = rm.close()
        assert isinstance(report, CloseReport)
        assert not dist.is_initialized()
        # a world of one: no barrier; the world and 2 subgroups destroyed; the world group and
        # the dropped subgroup are freed by close(), the held one is not (its workers were idle
        # when close() returned)
        assert report.barrier_s is None and report.destroyed == 3
        assert report.still_referenced == 1 and report.idle and report.busy_threads == []
        assert rm.close() == CloseReport()  # idempotent
        del held
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_fault_whose_step_was_resumed_past_fires_at_the_first_boundary(monkeypatch) -> None:
    """A preemption that landed later than the scenario planned (a loaded machine) resumes the
    next incarnation past a fault's step: the fault fires at its first boundary, once, instead
    of never (the resize scenario then ran to the end without its signal)."""
    fired: list[tuple[str, int]] = []
    monkeypatch.setattr(_hook, "fire", lambda f, *a: fired.append((f.kind, f.step)))
    hook = FaultHook(parse_faults("term:rank=0:step=6;usr1:rank=0:step=9"), rank=0, restart_count=0)
    for step in (7, 8, 9, 10):  # resumed at step 6
        hook.at_step_end(step)
        hook.after_save(step)
    assert fired == [("term", 6), ("usr1", 9)]
