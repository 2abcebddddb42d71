"""Retries: only known-transient errors, capped exponential backoff, end to end on memory://."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError
from fsspec.implementations.memory import MemoryFileSystem

from ftsdp import storage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._retry import is_transient, retry


def _client_error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "x"}}, "GetObject")


def test_transient_classification() -> None:
    wrapped = OSError("s3fs wrapper")
    wrapped.__cause__ = _client_error("SlowDown")
    for err in (ConnectionResetError(), TimeoutError(), _client_error("503"), wrapped):
        assert is_transient(err), err
    for err in (
        FileNotFoundError(),
        ValueError(),
        PermissionError(),
        _client_error("AccessDenied"),
    ):
        assert not is_transient(err), err


def test_backoff_is_capped_and_gives_up() -> None:
    io = storage.IOOptions(max_attempts=6, backoff_s=0.1, backoff_cap_s=0.3)
    sleeps: list[float] = []
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 6:
            raise ConnectionError("reset")
        return "ok"

    assert retry(io, flaky, sleep=sleeps.append) == "ok"
    assert sleeps == pytest.approx([0.1, 0.2, 0.3, 0.3, 0.3])
    calls["n"], sleeps[:] = -10, []
    with pytest.raises(ConnectionError):
        retry(io, flaky, sleep=sleeps.append)
    assert len(sleeps) == 5

    def broken() -> None:
        calls["n"] += 1
        raise ValueError("not transient")

    calls["n"] = 0
    with pytest.raises(ValueError):
        retry(io, broken, sleep=sleeps.append)
    assert calls["n"] == 1


def test_transient_failures_are_retried_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://retry-{uuid.uuid4().hex[:8]}"
    fast = storage.IOOptions(backoff_s=0.001)
    failures = {"write": 1, "read": 2}
    real_write, real_cat = Store._write_once, MemoryFileSystem.cat_file

    def write(self: Store, rel: str, produce: Any) -> None:
        if rel.endswith(".safetensors") and failures["write"]:
            failures["write"] -= 1
            raise TimeoutError("injected")
        real_write(self, rel, produce)

    def cat_file(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        if path.endswith(".safetensors") and failures["read"]:
            failures["read"] -= 1
            raise ConnectionResetError("injected")
        return real_cat(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(Store, "_write_once", write)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    ref = {"w": torch.randn(100)}
    storage.save(ref, url, step=1, options=storage.SaveOptions(io=fast))
    target = {"w": torch.zeros(100)}
    storage.load(target, url, options=storage.LoadOptions(io=fast))
    assert failures == {"write": 0, "read": 0}
    assert torch.equal(target["w"], ref["w"])


@pytest.mark.parametrize("fmt", ["ftsdp", "hf", "torch", "dcp"])
def test_every_format_retries_transient_errors(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Every format reads and writes through the store: a convert into ``fmt`` whose uploads fail
    once each after sending every byte, and a read back whose ranged reads fail, both succeed
    (each object is written again from the start, each read tried again)."""
    root = f"memory://retry-{uuid.uuid4().hex[:8]}"
    ref = {"w": torch.randn(300), "b": torch.randn(3, 4).bfloat16(), "step": 7}
    storage.save(ref, f"{root}/src", step=1)
    dst = f"{root}/out.pt" if fmt == "torch" else f"{root}/out"
    failed: dict[str, Any] = {"write": set(), "reads": 0, "read": 0}
    real_write, real_cat = Store._write_once, MemoryFileSystem.cat_file

    def write(self: Store, rel: str, produce: Any) -> None:
        path = self.full(rel)
        if "/out" not in path or path in failed["write"]:
            return real_write(self, rel, produce)
        failed["write"].add(path)

        def upload_fails_at_the_end(f: Any) -> None:
            produce(f)
            raise TimeoutError("injected: the upload timed out")

        return real_write(self, rel, upload_fails_at_the_end)

    def cat_file(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        if "/out" in path:
            failed["reads"] += 1
            if failed["reads"] % 2:  # every other read of the destination: each read once
                failed["read"] += 1
                raise ConnectionResetError("injected")
        return real_cat(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(Store, "_write_once", write)
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    storage.conversion.convert(f"{root}/src", dst, to=fmt)
    written = {p.rsplit("/", 1)[-1] for p in failed["write"]}
    commit_file = {"ftsdp": "manifest.json", "hf": "model.safetensors", "dcp": ".metadata"}
    assert commit_file.get(fmt, "out.pt") in written, written
    got = storage.load_state_dict(dst)
    assert failed["read"] >= 2, failed
    assert torch.equal(got["w"], ref["w"]) and torch.equal(got["b"], ref["b"])
