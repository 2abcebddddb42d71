"""Async save: staging copy, back-pressure, errors on wait, one save at a time. Also load_into."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.storage.io._fs import Store


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Data-object writes wait for ``gate['open']``; every write is logged in ``gate['log']``."""
    state: dict[str, Any] = {"open": threading.Event(), "log": [], "fail": None}
    real = Store._write_once

    def write(self: Store, rel: str, produce: Any) -> None:
        if rel.endswith(".safetensors"):
            state["open"].wait(30)
            if state["fail"]:
                raise state["fail"]
        state["log"].append(rel)
        real(self, rel, produce)

    monkeypatch.setattr(Store, "_write_once", write)
    return state


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(1000, generator=g) for i in range(6)}  # 4000 bytes each


def test_staging_budget_applies_back_pressure(tmp_path: Path, gate: dict) -> None:
    ref = _state()
    state = {k: v.clone() for k, v in ref.items()}
    opts = storage.SaveOptions(object_bytes=4000, staging_budget_bytes=8000)
    out: dict[str, Any] = {}
    saver = threading.Thread(
        target=lambda: out.setdefault(
            "h", storage.save(state, str(tmp_path), step=1, async_save=True, options=opts)
        )
    )
    saver.start()
    saver.join(0.5)
    assert saver.is_alive(), "save() must block while the staging budget is full"
    gate["open"].set()
    saver.join(30)
    handle = out["h"]
    for t in state.values():
        t.zero_()  # the caller owns its tensors again once save() returned
    handle.wait()
    assert handle.staging_peak_bytes <= 8000
    target = {k: torch.zeros(1000) for k in ref}
    storage.load(target, str(tmp_path))
    for k, v in ref.items():
        assert torch.equal(target[k], v)


def test_an_async_save_within_the_budget_holds_the_values_of_its_call(
    tmp_path: Path, gate: dict
) -> None:
    """Within the staging budget an async save copies this rank's share into its root's
    snapshot arena before it returns: the writes that follow read the copy."""
    ref = _state()
    state = {k: v.clone() for k, v in ref.items()}
    handle = storage.save(state, str(tmp_path), step=1, async_save=True)
    assert not handle.done(), "the writes wait for the gate: save() returned before them"
    for t in state.values():
        t.zero_()
    gate["open"].set()
    handle.wait()
    assert handle.staging_peak_bytes >= sum(v.numel() * v.element_size() for v in ref.values())
    target = {k: torch.zeros(1000) for k in ref}
    storage.load(target, str(tmp_path))
    for k, v in ref.items():
        assert torch.equal(target[k], v)


def test_error_surfaces_on_wait(tmp_path: Path, gate: dict) -> None:
    gate["fail"], url = OSError("injected upload failure"), str(tmp_path)
    gate["open"].set()
    handle = storage.save(_state(), url, step=1, async_save=True)
    with pytest.raises(OSError, match="injected upload failure"):
        handle.wait()
    assert handle.done() and storage.list_steps(url) == []
    # An error nobody waited for is raised by the next save instead of vanishing.
    unobserved = storage.save(_state(), url, step=2, async_save=True)
    while not unobserved.done():  # done() polls without observing the error
        time.sleep(0.01)
    gate["fail"] = None
    with pytest.raises(storage.CheckpointError, match=r"previous async save \(step 2 .* failed"):
        storage.save(_state(), url, step=3)
    storage.save(_state(), url, step=4)
    assert storage.list_steps(url) == [4]


def test_new_save_waits_for_previous_commit(tmp_path: Path, gate: dict) -> None:
    url = str(tmp_path)
    first = storage.save(_state(), url, step=1, async_save=True)
    second = threading.Thread(target=lambda: storage.save(_state(), url, step=2))
    second.start()
    second.join(0.3)
    assert second.is_alive() and not first.done()
    gate["open"].set()
    second.join(30)
    first.wait()
    log = gate["log"]
    assert log.index("step-1/manifest.json") < min(
        i for i, rel in enumerate(log) if rel.startswith("step-2/")
    )
    assert storage.list_steps(url) == [1, 2]


def test_load_into_meta_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    storage.save({"model": src.state_dict(), "step": 1}, str(tmp_path), step=1)
    with torch.device("meta"):
        dst = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    storage.load_into(dst, str(tmp_path), prefix="model.")
    x = torch.randn(5, 4)
    assert torch.equal(dst(x), src(x))


def test_a_commit_guard_refuses_commits_until_removed(tmp_path: Path) -> None:
    """A guard runs first in every commit of the process, sync or async, in the save's thread;
    raising refuses the commit (nothing committed), and once removed commits go on."""
    url, threads = str(tmp_path), []

    def refuse() -> None:
        threads.append(threading.current_thread().name)
        raise RuntimeError("the agent is gone")

    remove = storage.saving.guard_commits(refuse)
    try:
        with pytest.raises(RuntimeError, match="the agent is gone"):
            storage.save(_state(), url, step=1)
        handle = storage.save(_state(), url, step=2, async_save=True)
        with pytest.raises(RuntimeError, match="the agent is gone"):
            handle.wait()
        assert storage.list_steps(url) == []
    finally:
        remove()
    assert threads[0] == threading.current_thread().name != threads[1]  # async: its own thread
    storage.save(_state(), url, step=3)
    remove()  # idempotent
    assert storage.list_steps(url) == [3]
    loaded = storage.load_state_dict(url, step=3)
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())
