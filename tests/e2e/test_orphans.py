"""A worker outlives its agent no more: SIGKILL torchrun's agent alone (not its process group,
as the OOM killer would) and every worker exits, each with one line saying why, and commits
nothing after the kill (docs/elastic.md, "A worker without its agent").

The job is frozen (SIGSTOP on every process under the agent) while the test lists the committed
steps and kills the agent, so that the listing is exactly what was committed at the kill."""

from __future__ import annotations

import datetime
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from ftsdp import storage
from ftsdp.elastic import EXIT_STALL
from tests.e2e.test_faults import REPO, Run

DEADLINE_S = 30.0  # the watchdog's timeout (--heartbeat-timeout-s below): the bound required


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        kids = tree.get(todo.pop(), [])
        out += kids
        todo += kids
    return sorted(out)


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone (a zombie counts as gone: it runs no
    more, and whoever adopted it may not reap it at once)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return None if state in ("Z", "X") else state


def _wait(cond, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def _steps(url: str) -> list[int]:
    try:
        return storage.list_steps(url)
    except FileNotFoundError:
        return []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", [False, True], ids=["torchrun", "ftsdp.launch"])
def test_killing_the_agent_alone_ends_its_workers_and_their_commits(
    tmp_path: pathlib.Path, launch: bool
) -> None:
    run = Run(tmp_path / "job")
    memory = str(tmp_path / "memory")
    agent = ["--standalone", "--nproc-per-node=2", "--max-restarts=0", "--monitor-interval=0.2"]
    if launch:  # workers forked by a fork server, a child of the agent
        cmd = [sys.executable, "-m", "ftsdp.launch", *agent, "--"]
    else:  # workers started by the agent itself
        cmd = [sys.executable, "-m", "torch.distributed.run", *agent, "-m", "ftsdp.train"]
    train = [*run.args(), "--steps", "100000", "--checkpoint-every", "2", "--keep-last", "1000"]
    train += ["--memory-every", "1", "--memory-url", memory]
    train += ["--heartbeat-timeout-s", str(DEADLINE_S)]
    if launch:  # the persister writes this job's saves: it must end and commit nothing either
        train += ["--persister"]
    log = run.log_path("agent")
    roots = {"durable": run.url, "memory": memory}
    pids: list[int] = []
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [*cmd, *train], cwd=REPO, env=run.env(), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            _wait(  # past the first durable step: saves of both tiers are under way
                lambda: proc.poll() is None and len(_steps(run.url)) >= 2 and _steps(memory),
                180,
                "two durable steps and a memory step committed",
            )
            pids = _descendants(proc.pid)
            for pid in pids:  # freeze the job: the listing below is what the kill leaves
                os.kill(pid, signal.SIGSTOP)
            _wait(lambda: all(_state(p) in ("T", None) for p in pids), 10, "the job stopped")
            before = {name: _steps(url) for name, url in roots.items()}
            proc.send_signal(signal.SIGKILL)  # the agent alone, not its process group
            proc.wait()
            killed = time.time()  # the log's clock, to time each worker's line
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            gone_s = _wait(
                lambda: all(_state(p) is None for p in pids), DEADLINE_S, "the workers exited"
            )
        finally:
            for pid in [p for p in pids if _state(p) is not None]:
                os.kill(pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    after = {name: _steps(url) for name, url in roots.items()}
    output = log.read_text(errors="replace")

    # One line per worker says why it left, and nothing says it stalled instead.
    why = f"the torchrun agent (pid {proc.pid}) is gone: exiting with {EXIT_STALL}, "
    lines = [line for line in output.splitlines() if why in line]
    assert sorted(line.split("ftsdp (rank ")[1][0] for line in lines) == ["0", "1"], output[-6000:]
    assert "stalled" not in output, output[-6000:]
    said = [
        datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - killed
        for line in lines
    ]
    print(
        f"lines {', '.join(f'{s:.2f}' for s in said)} s and every process under the agent gone "
        f"{gone_s:.2f} s after the kill; steps at the kill {before}, after {after}"
    )

    # Nothing committed after the kill. The commit guard runs first in every commit, so a save
    # started after the kill is refused; a commit that passed its guard before the kill may
    # still create its manifest (the window is a few file operations). A root has one save in
    # flight at a time, so at most one step per root, newer than all of them, may appear.
    for name in roots:
        new = sorted(set(after[name]) - set(before[name]))
        assert len(new) <= 1 and all(s > max(before[name]) for s in new), (name, before, after)
        if not new:  # no commit: the newest step is the kill's; only the retention of a
            # commit made before the kill (its step among those listed then) may still remove
            # older steps
            assert set(after[name]) <= set(before[name]), (name, before, after)
            assert max(after[name]) == max(before[name]), (name, before, after)
