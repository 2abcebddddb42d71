"""``python -m ftsdp.launch``'s command line: torchrun's flags before ``--``, ftsdp.train's after
it, turned into torchrun's own command line (``--run-path`` to ftsdp/train.py, forkserver unless
the caller chose a start method). Its jobs run in tests/e2e/test_faults.py (job A)."""

from __future__ import annotations

import pytest

import ftsdp.train
from ftsdp import launch


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
