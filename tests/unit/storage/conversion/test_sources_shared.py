"""Sources shared by threads, and over files that change while they are open: a source's reads
may be called from several threads at once, each getting the tensor it asked for; a local hf or
torch file replaced (renamed over) or rewritten in place since it was opened raises an error
naming it, no descriptor kept between reads (docs/cli.md, "Python API for inference")."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save, save_file

from ftsdp import storage
from ftsdp.storage._errors import CorruptCheckpointError
from ftsdp.storage.conversion._formats import open_source
from ftsdp.storage.io import _local


def _strided(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(16, 16, generator=g).t() for i in range(n)}


class _Held:
    """Makes the lookups of one container wait, in ``thread`` only, until ``go`` is set: the
    place where another thread replaces a source's cache between a reader's check and its copy.
    ``key`` picks the lookup that waits (``None``: ``in``)."""

    def __init__(self, thread: str, key: object = None) -> None:
        self.thread, self.key = thread, key
        self.waiting, self.go = threading.Event(), threading.Event()

    def pause(self, key: object) -> None:
        if threading.current_thread().name == self.thread and key == self.key:
            self.waiting.set()
            assert self.go.wait(10)


def _interleave(first: Callable[[], Any], second: Callable[[], Any], held: _Held) -> Any:
    """Run ``first`` in a thread until ``held`` stops it, ``second`` meanwhile to its end, then
    let ``first`` finish; its result."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = first()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, name=held.thread)
    t.start()
    assert held.waiting.wait(10)
    second()
    held.go.set()
    t.join(10)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_torch_strided_cache_replaced_by_another_thread_between_check_and_copy(
    tmp_path: Path,
) -> None:
    ref = _strided(2)
    path = str(tmp_path / "s.pt")
    torch.save(ref, path)
    source = open_source(path)
    out = torch.empty(256)
    source.read_into([("w0", 0, out)])  # w0 is now the cached strided tensor
    held = _Held("reader", key=0)

    class Slow(tuple):
        def __getitem__(self, i: Any) -> Any:
            held.pause(i)
            return super().__getitem__(i)

    source._cache = Slow(source._cache)  # type: ignore[attr-defined]
    a, b = torch.empty(256), torch.empty(256)
    _interleave(
        lambda: source.read_into([("w0", 0, a)]),
        lambda: source.read_into([("w1", 0, b)]),  # replaces the cache meanwhile
        held,
    )
    assert torch.equal(a, ref["w0"].reshape(-1))  # before: w1's values
    assert torch.equal(b, ref["w1"].reshape(-1))
    source.close()


def test_dcp_cache_replaced_by_another_thread_between_check_and_copy(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ref = _strided(2)
    path = str(tmp_path / "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(ref, checkpoint_id=path, no_dist=True)
    source = open_source(path, chunk=1)  # a tensor at a time through DCP's reader
    assert source._layout("w0") is None  # type: ignore[attr-defined]
    out = torch.empty(256)
    source.read_into([("w0", 0, out)])
    held = _Held("reader", key=None)

    class Slow(dict):
        def __contains__(self, name: object) -> bool:
            found = super().__contains__(name)
            held.pause(None)  # found: the reader copies next
            return found

    source._cache = Slow(source._cache)  # type: ignore[attr-defined]
    a, b = torch.empty(256), torch.empty(256)
    _interleave(
        lambda: source.read_into([("w0", 0, a)]),
        lambda: source.read_into([("w1", 0, b)]),
        held,
    )
    assert torch.equal(a, ref["w0"].reshape(-1))  # before: KeyError 'w0'
    assert torch.equal(b, ref["w1"].reshape(-1))
    source.close()


@pytest.fixture
def fast_switches() -> Any:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("fmt", ["torch", "hf", "ftsdp"])
def test_threads_sharing_a_lazy_state_dict_each_get_their_tensor(
    tmp_path: Path, fmt: str, fast_switches: None
) -> None:
    ref = _strided(8)
    if fmt == "torch":
        url = str(tmp_path / "s.pt")
        torch.save(ref, url)
    elif fmt == "hf":
        url = str(tmp_path / "hf")
        os.makedirs(url)
        save_file({k: v.contiguous() for k, v in ref.items()}, f"{url}/model.safetensors")
    else:
        url = str(tmp_path / "root")
        storage.save(ref, url, step=1)
    lz = storage.LazyStateDict(url, cache=False)
    bad: list[str] = []

    def worker(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(300):
            k = r.choice(list(ref))
            try:
                if not torch.equal(lz[k], ref[k]):
                    bad.append(k)
            except Exception as e:
                bad.append(f"{k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lz.close()
    assert not bad, bad[:5]


# -- files changed under an open source ---------------------------------------------------------


def _versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    v1 = {"a": torch.randn(1000, generator=g), "b": torch.randn(1000, generator=g)}
    # a new export: one more tensor (a longer header), new values
    v2 = {"a": v1["a"] + 100, "b": v1["b"] + 100, "c": torch.zeros(10)}
    return v1, v2


def _write(fmt: str, state: dict[str, torch.Tensor], path: str) -> None:
    """``state`` as ``fmt`` at ``path``, through the file's own inode (in place)."""
    if fmt == "hf":
        data = save(state)
    else:
        import io

        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.write(data)
        f.truncate()


def _target(tmp_path: Path, fmt: str) -> tuple[str, str]:
    """(URL to open, the file it reads)."""
    if fmt == "hf":
        os.makedirs(tmp_path / "hf")
        return str(tmp_path / "hf"), str(tmp_path / "hf" / "model.safetensors")
    return str(tmp_path / "m.pt"), str(tmp_path / "m.pt")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_file_replaced_by_rename_raises_naming_it(tmp_path: Path, fmt: str) -> None:
    v1, v2 = _versions()
    url, path = _target(tmp_path, fmt)
    _write(fmt, v1, path)
    before = _fds()
    lz = storage.LazyStateDict(url)
    assert torch.equal(lz["a"], v1["a"])
    assert _fds() == before  # no descriptor is kept between reads
    _write(fmt, v2, path + ".new")
    os.replace(path + ".new", path)
    with pytest.raises(CorruptCheckpointError, match="changed since it was opened"):
        lz.read("b", 0, 1000)  # before: the bytes of v2 at v1's offsets
    lz.close()
    assert _fds() == before
    with pytest.raises(ValueError, match="closed"):
        lz.read("b", 0, 1)
    with storage.LazyStateDict(url) as again:  # opened again: the new version
        assert torch.equal(again["b"], v2["b"]) and "c" in again


@pytest.mark.parametrize("fmt", ["hf", "torch"])
@pytest.mark.parametrize("same_size", [False, True])
def test_file_rewritten_in_place_raises_naming_it(
    tmp_path: Path, fmt: str, same_size: bool
) -> None:
    v1, v2 = _versions()
    if same_size:
        v2 = {k: v + 100 for k, v in v1.items()}
    url, path = _target(tmp_path, fmt)
    _write(fmt, v1, path)
    lz = storage.LazyStateDict(url)
    assert torch.equal(lz["a"], v1["a"])
    time.sleep(0.05)  # past the file system's timestamp granularity
    _write(fmt, v2, path)
    with pytest.raises(CorruptCheckpointError, match="changed since it was opened") as e:
        lz["b"]  # before: v2's bytes at v1's offsets (or with a same size, v2's values)
    assert path in str(e.value)
    with pytest.raises(CorruptCheckpointError, match="changed since it was opened"):
        lz.fill_ranges([("b", 0, torch.empty(5))])
    lz.close()


def test_rewrite_racing_a_read_is_caught_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check follows the read: a rewrite during the read (here: right after the bytes came)
    is caught, though the file was unchanged when the read began."""
    v1, v2 = _versions()
    url, path = _target(tmp_path, "hf")
    _write("hf", v1, path)
    lz = storage.LazyStateDict(url)
    real = os.preadv

    def preadv_then_rewrite(fd: int, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        time.sleep(0.05)
        _write("hf", v2, path)
        return n

    monkeypatch.setattr(_local.os, "preadv", preadv_then_rewrite)
    with pytest.raises(CorruptCheckpointError, match="changed since it was opened"):
        lz["b"]
    monkeypatch.undo()
    lz.close()


def test_a_local_lazy_state_dict_reads_in_a_forked_child(tmp_path: Path) -> None:
    v1, _ = _versions()
    url, path = _target(tmp_path, "hf")
    _write("hf", v1, path)
    with storage.LazyStateDict(url) as lz:
        assert torch.equal(lz["a"], v1["a"])
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = torch.equal(lz["b"], v1["b"]) and torch.equal(lz.read("a", 3, 4), v1["a"][3:7])
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert torch.equal(lz["b"], v1["b"])


def test_a_model_in_more_shards_than_the_open_file_limit_reads(tmp_path: Path) -> None:
    """300 shards under a limit of 256 open files: no descriptor is kept per shard (keeping
    them, the reader failed with 'Too many open files' at the 251st)."""
    import resource

    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    weight_map = {}
    for i in range(300):
        name = f"model-{i + 1:05d}-of-00300.safetensors"
        save_file({f"layer{i}.w": torch.full((2,), float(i))}, str(folder / name))
        weight_map[f"layer{i}.w"] = name
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        got = storage.load_state_dict(str(folder), keys=["layer0.w", "layer299.w"])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert torch.equal(got["layer299.w"], torch.full((2,), 299.0))


def test_a_rewrite_whose_modification_time_is_put_back_raises(tmp_path: Path) -> None:
    """cp -p, rsync -t or os.utime can restore a file's modification time; its change time
    still tells the rewrite."""
    v1, _ = _versions()
    url, path = _target(tmp_path, "hf")
    _write("hf", v1, path)
    lz = storage.LazyStateDict(url)
    st = os.stat(path)
    with open(path, "r+b") as f:  # same size, other bytes
        f.seek(st.st_size - 4)
        f.write(b"\xff\xff\xff\xff")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CorruptCheckpointError, match="changed since it was opened"):
        lz["b"]
    lz.close()
