"""Output goes through logging: the library prints nothing (save, load, convert, retention,
CheckpointManager, the preemption handler, the watchdog, the metrics log); the training entry
installs one handler (time, rank, level; progress on stdout, warnings on stderr) and
``--log-level``; ``ftsdp.__version__`` and ``--version`` on both commands."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
import warnings

import pytest
import torch

import ftsdp
from ftsdp import storage
from ftsdp.elastic import PreemptionHandler, Watchdog
from ftsdp.tools.ckpt import main as ckpt_main
from ftsdp.train import main as train_main
from ftsdp.trainer._session import MetricsLog, console_logging

PREFIX = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} rank (\d+) (INFO|WARNING|ERROR) ([\w.]+): "


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class _FailingStore:
    """A c10d store whose first ``set`` works and everything after fails."""

    def __init__(self) -> None:
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        self.sets += 1
        if self.sets > 1:
            raise ConnectionError("store went away")

    def __getattr__(self, name: str):
        raise ConnectionError("store went away")


def test_the_library_prints_nothing_and_logs_instead(tmp_path, capsys, caplog) -> None:
    """A save/load/convert/retention/CheckpointManager cycle, a signal, a failing watchdog and
    the metrics log: nothing on stdout or stderr, no warnings.warn; the events that matter are
    log records of ``ftsdp.*`` loggers (before: print() and warnings.warn)."""
    caplog.set_level(logging.DEBUG, logger="ftsdp")
    root = tmp_path / "ck"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = ftsdp.CheckpointManager(str(root), model, opt, async_save=False, keep_last=1)
        ckpt.save(1, {"step": 1})
        (root / "step-0").mkdir()  # a user's folder in the root: retention leaves it alone
        (root / "step-0" / "notes.txt").write_text("mine")
        ckpt.save(2, {"step": 2})
        ckpt.close()
        assert storage.list_steps(str(root)) == [2]
        state = storage.load_state_dict(str(root))
        assert torch.equal(state["model.weight"], model.weight.detach())
        storage.conversion.convert(str(root), str(tmp_path / "hf"), to="hf", model_only=True)
        storage.catalog.apply_retention(str(root), keep_last=1)

        with PreemptionHandler(grace_s=30) as h:  # default log: the logger, not stderr
            os.kill(os.getpid(), signal.SIGUSR1)
            assert _wait_for(lambda: "SIGUSR1 received" in caplog.text)
            assert h.requested
        dog = Watchdog(_FailingStore(), 0, 2, interval_s=0.01, heartbeat_timeout_s=1.0).start()
        assert _wait_for(lambda: dog.error is not None and "watchdog on rank 0" in caplog.text)
        log = MetricsLog(None, enabled=True)
        log.write("step 1/1 | loss 1.0", {"event": "step"})
        log.event({"event": "fault"}, "a peer is gone")
    assert capsys.readouterr() == ("", ""), "library code printed"
    assert [str(w.message) for w in caught] == []
    by_logger = {(r.name, r.levelname) for r in caplog.records}
    assert {
        ("ftsdp.storage.format._steps", "WARNING"),  # retention left the user's step-0 alone
        ("ftsdp.elastic._signals", "WARNING"),
        ("ftsdp.elastic._watchdog", "ERROR"),
        ("ftsdp.train", "INFO"),
        ("ftsdp.train", "WARNING"),
    } <= by_logger, by_logger
    assert "retention left alone" in caplog.text and "step-0: left alone" in caplog.text


def test_the_entry_handler_format_streams_and_levels(capsys) -> None:
    """Time, rank, level and logger on every line; INFO on stdout, WARNING+ on stderr; rank 0
    shows --log-level and up, other ranks WARNING and up; removing it restores the logger."""
    ftsdp_logger = logging.getLogger("ftsdp")
    before = (list(ftsdp_logger.handlers), ftsdp_logger.level)
    log = logging.getLogger("ftsdp.train")
    for level, rank, shown in [
        ("INFO", 0, {"INFO", "WARNING", "ERROR"}),
        ("INFO", 3, {"WARNING", "ERROR"}),
        ("WARNING", 0, {"WARNING", "ERROR"}),
        ("ERROR", 2, {"ERROR"}),
    ]:
        remove = console_logging(level, rank)
        try:
            log.debug("a debug line")
            log.info("step 1/2 | loss 1.5")
            log.warning("a warning")
            log.error("an error")
        finally:
            remove()
        out, err = capsys.readouterr()
        for stream, levels in ((out, {"INFO"}), (err, {"WARNING", "ERROR"})):
            lines = stream.splitlines()
            assert len(lines) == len(levels & shown), (level, rank, stream)
            for line in lines:
                m = re.match(PREFIX + r"(.*)$", line)
                assert m, line
                assert m.group(1) == str(rank) and m.group(2) in levels & shown
                assert m.group(3) == "ftsdp.train"
        if "INFO" in shown:
            assert re.search(PREFIX + r"step 1/2 \| loss 1.5$", out, re.M), out
    assert (list(ftsdp_logger.handlers), ftsdp_logger.level) == before

    with pytest.raises(ValueError, match="log level"):
        console_logging("LOUD", 0)


@pytest.fixture
def world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FTSDP_FAULT"):
        monkeypatch.delenv(key, raising=False)


TINY = [
    *["--vocab-size", "16", "--block-size", "8", "--n-layer", "1", "--n-head", "1"],
    *["--n-embd", "8", "--global-batch", "2", "--micro-batch", "2", "--steps", "2"],
    *["--log-every", "1", "--device", "cpu", "--heartbeat-timeout-s", "0"],
]


def test_log_level_warning_silences_the_step_lines(world_of_one, capsys) -> None:
    assert train_main(TINY) == 0
    out, _ = capsys.readouterr()
    steps = re.findall(PREFIX + r"step (\d)/2 \| loss", out)
    assert [(r, lvl, name, s) for r, lvl, name, s in steps] == [
        ("0", "INFO", "ftsdp.train", "1"),
        ("0", "INFO", "ftsdp.train", "2"),
    ], out
    assert train_main([*TINY, "--log-level", "warning"]) == 0  # any case
    assert capsys.readouterr() == ("", "")
    assert not logging.getLogger("ftsdp").handlers  # the entry removed its handler


@pytest.mark.parametrize("command", ["train", "ckpt"])
def test_version_on_both_commands(command, capsys) -> None:
    main = train_main if command == "train" else ckpt_main
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"ftsdp-{command} {ftsdp.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", ftsdp.__version__)
