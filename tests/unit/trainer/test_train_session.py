"""The training session (``ftsdp.trainer._session``): opened in order on an ExitStack, closed in
reverse; ``close`` runs every closer and raises the first error, twice is fine, and a failure
midway through ``open`` closes what was opened. The heavy parts (process group, signal
handlers, watchdog, files) are fakes that record when they close. Then the step hook, in a real
run of one process: called where the fault suite expects it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from typing import ClassVar

import pytest

from ftsdp.trainer import _session
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._session import Closers, NoStepHook, Session, StepHook

pytestmark = pytest.mark.timeout(120)


class _Part:
    """A fake part: records its close in ``closed``; raises ``fail[name]`` when closing."""

    def __init__(self, name: str, closed: list[str], fail: dict[str, BaseException]) -> None:
        self.name, self._closed, self._fail = name, closed, fail

    def close(self) -> None:
        self._closed.append(self.name)
        if self.name in self._fail:
            raise self._fail[self.name]


@dataclasses.dataclass
class _Fakes:
    closed: list[str] = dataclasses.field(default_factory=list)
    fail_close: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    fail_open: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    events: list[dict] = dataclasses.field(default_factory=list)

    def part(self, name: str) -> _Part:
        if name in self.fail_open:
            raise self.fail_open[name]
        return _Part(name, self.closed, self.fail_close)


@pytest.fixture
def fakes(monkeypatch) -> _Fakes:
    f = _Fakes()

    class RankManager(_Part):
        rank, world_size, incarnation, peers, agent = 0, 2, "inc0", [], None
        marks: ClassVar[dict[str, float]] = {}  # init's stage times (none here)
        info = dataclasses.make_dataclass("Info", [("restart_count", int, 3)])()

        @classmethod
        def init(cls, **kw):
            f.part("rm")
            return cls("rm", f.closed, f.fail_close)

        def store(self, prefix, timeout_s=None):
            return "store"  # a world of 2 has one (the watchdog's fake takes anything)

        def exit_if_orphaned(self):
            f.part("agent checked")

    class MetricsLog(_Part):
        def __init__(self, path, enabled, rank=0):
            f.part("log")
            super().__init__("log", f.closed, f.fail_close)

        def event(self, record, line=None, level=None):
            f.events.append(record)

    class PreemptionHandler(_Part):
        def __init__(self, grace_s):
            super().__init__("preempt", f.closed, f.fail_close)

        def install(self):
            f.part("preempt")
            return self

    class Watchdog(_Part):
        def __init__(self, *args, **kw):
            super().__init__("watchdog", f.closed, f.fail_close)

        def start(self):
            f.part("watchdog")
            return self

    monkeypatch.setattr(_session, "RankManager", RankManager)
    monkeypatch.setattr(_session, "MetricsLog", MetricsLog)
    monkeypatch.setattr(_session, "PreemptionHandler", PreemptionHandler)
    monkeypatch.setattr(_session, "Watchdog", Watchdog)
    monkeypatch.setattr(_session, "_open_append", lambda path: f.part("ledger"))
    return f


CFG = TrainConfig(ledger="ledger.jsonl", heartbeat_timeout_s=4.0, device="cpu")
OPENED = ["rm", "log", "preempt", "watchdog", "ledger"]


def test_the_session_is_built_in_order_and_closed_in_reverse(fakes) -> None:
    made = []

    def hook(**kw):
        made.append(kw)
        return NoStepHook()

    session = Session.open(CFG, hook=hook)
    assert made == [{"rank": 0, "restart_count": 3, "incarnation": "inc0", "agent": None}]
    assert isinstance(session.hook, StepHook)
    assert session.watchdog is not None and session.ledger is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        session.rm = None  # type: ignore[misc]
    assert fakes.closed == []
    session.close()
    assert fakes.closed == OPENED[::-1]
    assert isinstance(Session.open(CFG).hook, NoStepHook)  # the default hook


def test_close_runs_every_closer_and_raises_the_first_error(fakes, caplog) -> None:
    # reverse order: ledger, watchdog (fails first), preempt, log (fails), rm (fails last)
    fakes.fail_close.update(
        watchdog=RuntimeError("watchdog"), log=OSError("log"), rm=ValueError("rm")
    )
    session = Session.open(CFG)
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="watchdog"):
        session.close()
    assert fakes.closed == OPENED[::-1]
    assert "OSError: log" in caplog.text and "ValueError: rm" in caplog.text


def test_close_twice_is_fine(fakes) -> None:
    fakes.fail_close["preempt"] = RuntimeError("once")
    session = Session.open(CFG)
    with pytest.raises(RuntimeError, match="once"):
        session.close()
    session.close()  # nothing left to close, nothing raised
    assert fakes.closed == OPENED[::-1]


@pytest.mark.parametrize("failing", OPENED)
def test_a_failure_midway_through_open_closes_what_was_opened(fakes, failing) -> None:
    fakes.fail_open[failing] = RuntimeError(f"cannot open {failing}")
    fakes.fail_close["rm"] = OSError("a closer fails too")  # the opening error still wins
    with pytest.raises(RuntimeError, match=f"cannot open {failing}"):
        Session.open(CFG)
    assert fakes.closed == OPENED[: OPENED.index(failing)][::-1]


def test_a_failing_hook_factory_closes_what_was_opened(fakes) -> None:
    def hook(**kw):
        raise ValueError("FTSDP_FAULT: bad spec")

    with pytest.raises(ValueError, match="bad spec"):
        Session.open(CFG, hook=hook)
    assert fakes.closed == ["log", "rm"]  # the hook is made after the log, before the signals


def test_as_a_context_manager_an_error_is_recorded_and_wins_over_a_close_error(fakes) -> None:
    fakes.fail_close["watchdog"] = RuntimeError("close failed")
    with pytest.raises(KeyError, match="boom"), Session.open(CFG):
        raise KeyError("boom")
    assert fakes.closed == OPENED[::-1]
    assert [e["event"] for e in fakes.events] == ["error"]
    assert fakes.events[0]["error"] == "KeyError: 'boom'"
    # Without an error in flight, the close error is the error.
    fakes.closed.clear()
    with pytest.raises(RuntimeError, match="close failed"), Session.open(CFG):
        pass
    assert fakes.closed == OPENED[::-1]


def test_closers_raise_the_first_error_where_an_exit_stack_raises_the_last() -> None:
    def fail(message: str):
        def close() -> None:
            raise RuntimeError(message)

        return close

    stack = contextlib.ExitStack()
    closers = Closers()
    for name in ("opened first", "opened last"):
        stack.callback(fail(name))
        closers.push(fail(name))
    # ExitStack: the error of the closer that ran last (the one opened first) wins.
    with pytest.raises(RuntimeError, match="opened first"):
        stack.close()
    # Closers: the first error raised while closing (the one opened last) wins.
    with pytest.raises(RuntimeError, match="opened last"):
        closers.close()


# -- the step hook in a real run ------------------------------------------------------------------


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_loop_calls_the_hook_at_the_step_boundaries(tmp_path, monkeypatch) -> None:
    """``at_step_end`` before the agreement and any checkpoint of the step; ``after_save`` after
    the checkpoint and the log line (the fault suite measures recovery from those points)."""
    from ftsdp import storage
    from ftsdp.trainer._job import build
    from ftsdp.trainer._loop import run

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    metrics, url = tmp_path / "metrics.jsonl", str(tmp_path / "ckpt")
    cfg = TrainConfig(
        vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, global_batch=4,
        micro_batch=2, steps=4, warmup=1, log_every=2, device="cpu", checkpoint_url=url,
        checkpoint_every=2, async_save=False, metrics=str(metrics),
    )  # fmt: skip
    calls: list[tuple] = []

    class Recorder:
        def checkpoint_url(self, got: str) -> str:
            calls.append(("checkpoint_url", got))
            return got

        def at_step_end(self, step: int) -> None:
            seen = [(r["event"], r.get("step")) for r in _records(metrics)]
            calls.append(("at_step_end", step, storage.list_steps(url), seen[-1]))

        def after_save(self, step: int) -> None:
            seen = [(r["event"], r.get("step")) for r in _records(metrics)]
            calls.append(("after_save", step, storage.list_steps(url), seen[-1]))

    with Session.open(cfg, hook=lambda **kw: Recorder()) as session:
        assert run(cfg, session, build(cfg, session)) == 0
    assert calls == [
        ("checkpoint_url", url),
        ("at_step_end", 1, [], ("phases", None)),  # the first step wrote its phases record
        ("after_save", 1, [], ("phases", None)),
        ("at_step_end", 2, [], ("phases", None)),  # before the save of step 2 and its log line
        ("after_save", 2, [2], ("step", 2)),  # after the checkpoint and the log line
        ("at_step_end", 3, [2], ("step", 2)),
        ("after_save", 3, [2], ("step", 2)),
        ("at_step_end", 4, [2], ("step", 2)),
        ("after_save", 4, [2, 4], ("step", 4)),
    ]
    assert ("checkpoint", 2) in [(r["event"], r.get("step")) for r in _records(metrics)]


# -- a peer lost: one line, no traceback (ftsdp.trainer._loop) ---------------------------------

GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:907: "
    "Connection reset by peer"
)
GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:228. This is typically caused by a remote worker crashing. Check the logs of "
    "the remote worker before reporting an error. GLHF!"
)


def test_peer_lost_tells_a_dead_peer_from_a_bug() -> None:
    import torch.distributed as dist

    from ftsdp.trainer._loop import peer_lost

    assert peer_lost(RuntimeError(GLOO_RESET)) and peer_lost(RuntimeError(GLOO_CLOSED))
    assert peer_lost(dist.DistNetworkError("store: Broken pipe"))
    assert not peer_lost(RuntimeError("shape mismatch: [4] vs [5]"))
    assert not peer_lost(ValueError("Connection reset by peer"))  # not a collective's error


class _Preempt:
    def __init__(self, signal_name: str | None) -> None:
        self.signal_name, self.why = signal_name, None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def cannot_save(self, why: str) -> None:
        self.why = why


class _Ckpt:
    def __init__(self, committed: dict[str, int]) -> None:
        self.committed = committed

    def newest_committed(self) -> dict[str, int]:
        return self.committed


@pytest.mark.parametrize(
    ("committed", "signal_name", "error", "line"),
    [
        (
            {"durable": 20},
            None,
            GLOO_RESET,
            "peer lost: Read error [127.0.0.1]:907: Connection reset by peer; exiting without "
            "saving, the restart resumes from step 20 (durable)",
        ),
        (
            {"durable": 20, "memory": 22},
            "SIGTERM",
            GLOO_CLOSED,
            "peer lost after SIGTERM: Connection closed by peer [127.0.0.1]:228; exiting without "
            "saving, the restart resumes from step 22 (memory)",
        ),
        (
            {},
            None,
            GLOO_RESET,
            "peer lost: Read error [127.0.0.1]:907: Connection reset by peer; exiting without "
            "saving, the restart resumes from step 0 (nothing committed yet)",
        ),
        (
            None,
            None,
            GLOO_RESET,
            "peer lost: Read error [127.0.0.1]:907: Connection reset by peer; exiting without "
            "saving, the restart resumes from step 0 (no --checkpoint-url)",
        ),
    ],
)
def test_a_lost_peer_is_one_line_naming_the_resume_step(committed, signal_name, error, line):
    from types import SimpleNamespace

    from ftsdp.trainer._loop import EXIT_PEER_LOST, _peer_lost

    events: list[tuple[dict, str, int]] = []
    closes: list[bool] = []
    session = SimpleNamespace(
        preempt=_Preempt(signal_name),
        rm=SimpleNamespace(
            close=lambda barrier: closes.append(barrier), exit_if_orphaned=lambda: None
        ),
        log=SimpleNamespace(event=lambda record, text, level: events.append((record, text, level))),
    )
    job = SimpleNamespace(ckpt=None if committed is None else _Ckpt(committed))
    assert _peer_lost(session, job, RuntimeError(error)) == EXIT_PEER_LOST != 0  # torchrun restarts
    ((record, text, level),) = events
    assert text == line and level == logging.ERROR
    assert record["event"] == "error" and record["peer_lost"] and record["error"].endswith(error)
    assert session.preempt.why == "a peer process was lost"  # a later SIGTERM promises no save
    assert closes == [False]  # no barrier: the peer never comes
