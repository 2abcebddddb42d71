"""The one store layer (storage/io): a store rooted at a single file, ranged views for
``torch.load``, the backend chosen by the URL, and the rules that keep every format on it (only
the io room touches fsspec; DCP's pickle is loaded in one function)."""

from __future__ import annotations

import ast
import io
import pathlib
import random
import uuid
from typing import Any

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from ftsdp import storage
from ftsdp.storage.io._fs import Store

STORAGE = pathlib.Path(__file__).resolve().parents[4] / "storage"


def test_a_store_rooted_at_a_file(tmp_path: pathlib.Path) -> None:
    data = bytes(range(256)) * 40
    (tmp_path / "f.bin").write_bytes(data)
    store = Store(str(tmp_path / "f.bin"), None)
    assert store.exists() and store.isfile() and not store.isdir()
    assert store.size() == len(data) and store.read() == data
    assert store.read_range("", 100, 110) == data[100:110]
    out = torch.empty(64, dtype=torch.uint8)
    store.read_into("", 1000, out.numpy())
    assert bytes(out.numpy()) == data[1000:1064]
    with pytest.raises(OSError, match="truncated"):
        store.read_into("", len(data) - 10, bytearray(20))
    store.write("", lambda f: f.write(b"new"))  # atomic replace of the file itself
    assert (tmp_path / "f.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]  # no temporary left
    missing = Store(str(tmp_path / "nope.bin"), None)
    assert not missing.exists()
    with pytest.raises(FileNotFoundError):
        missing.open()


def test_a_ranged_view_reads_like_a_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Store.open`` behaves as a file over its range whatever the reads and seeks, and serves
    the many small reads of ``torch.load`` from a few requests."""
    url = f"memory://view-{uuid.uuid4().hex[:8]}"
    data = bytes(random.Random(0).randbytes(300_000))
    store = Store(url, None)
    store.write_bytes("obj", data)
    rng = random.Random(1)
    view, ref = store.open("obj", 1000, 250_000), io.BytesIO(data[1000:250_000])
    for _ in range(300):
        op = rng.choice(["read", "read", "seek", "seek_end"])
        if op == "read":
            n = rng.choice([1, 7, 100, 5000, 100_000, -1])
            assert view.read(n) == ref.read(n)
        elif op == "seek":
            pos = rng.randrange(0, 260_000)
            assert view.seek(pos) == ref.seek(min(pos, 249_000))
        else:
            back = rng.randrange(0, 3000)
            assert view.seek(-back, io.SEEK_END) == ref.seek(-back, io.SEEK_END)
        assert view.tell() == ref.tell()

    requests: list[Any] = []
    real = MemoryFileSystem.cat_file

    def cat_file(self: Any, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        requests.append((start, end))
        return real(self, path, start=start, end=end, **kw)

    buf = io.BytesIO()
    torch.save({f"t{i}": torch.full((10,), float(i)) for i in range(20)}, buf)
    store.write_bytes("state.pt", buf.getvalue())
    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    with store.open("state.pt") as f:
        meta = torch.load(f, map_location="meta", weights_only=True)
    assert len(meta) == 20
    assert len(requests) <= 3, requests  # dozens of small reads, one read-ahead window


def test_every_format_reads_single_file_checkpoints_through_the_store(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf and torch single files open and read through ``Store`` (no other I/O path)."""
    state = {"w": torch.randn(50), "b": torch.arange(6).reshape(2, 3)}
    storage.save(state, str(tmp_path / "src"), step=1)
    for name, fmt in (("m.safetensors", "hf"), ("m.pt", "torch")):
        storage.conversion.convert(str(tmp_path / "src"), str(tmp_path / name), to=fmt)
    reads: list[str] = []
    real = Store._read_into_once

    def spy(self: Store, rel: str, start: int, view: memoryview) -> None:
        reads.append(self.where(rel))
        real(self, rel, start, view)

    monkeypatch.setattr(Store, "_read_into_once", spy)
    for name in ("m.safetensors", "m.pt"):
        got = storage.load_state_dict(str(tmp_path / name))
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
        assert reads and set(reads) == {str(tmp_path / name)}
        reads.clear()


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_only_the_store_touches_fsspec() -> None:
    users = {p.parent.name for p in STORAGE.rglob("*.py") if "fsspec" in _imports(p)}
    assert users == {"io"}


def test_a_store_is_the_backend_of_its_urls_filesystem(tmp_path: pathlib.Path) -> None:
    """``Store(url)`` builds the local, S3 or generic fsspec backend, by the URL's filesystem."""
    from ftsdp.storage.io._local import LocalStore
    from ftsdp.storage.io._s3 import S3Store

    pytest.importorskip("s3fs")
    for url, kind in (
        (str(tmp_path), LocalStore),
        (f"file://{tmp_path}", LocalStore),
        ("memory://x", Store),
        ("s3://bucket/x", S3Store),
        ("s3a://bucket/x", S3Store),
    ):
        store = Store(url, None)
        assert type(store) is kind and store.local == (kind is LocalStore), url


def test_dcp_metadata_is_unpickled_in_one_function(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pickle`` is loaded only in ``unpickle_metadata``, and every DCP read goes through it:
    replacing it (as a restricted unpickler will) changes how every DCP checkpoint opens."""
    loads = [
        (p.name, node.lineno)
        for p in STORAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("load", "loads", "Unpickler")
        and isinstance(node.value, ast.Name)
        and node.value.id == "pickle"
    ]
    assert len(loads) == 1 and loads[0][0] == "_dcp.py", loads
    from ftsdp.storage.conversion import _dcp

    storage.save({"w": torch.randn(30), "step": 2}, str(tmp_path / "src"), step=1)
    storage.conversion.convert(str(tmp_path / "src"), str(tmp_path / "dcp"), to="dcp")
    seen: list[int] = []
    real = _dcp.unpickle_metadata

    def spy(data: bytes, *args: Any) -> Any:
        seen.append(len(data))
        return real(data, *args)

    monkeypatch.setattr(_dcp, "unpickle_metadata", spy)
    assert storage.load_state_dict(str(tmp_path / "dcp"))["w"].numel() == 30
    assert seen
    monkeypatch.setattr(_dcp, "unpickle_metadata", lambda data, *args: 1 / 0)
    with pytest.raises(storage.CorruptCheckpointError, match="cannot read .metadata"):
        storage.load_state_dict(str(tmp_path / "dcp"))


def test_a_local_listing_tells_what_fsspec_tells(tmp_path: pathlib.Path) -> None:
    """``listdir`` of a local root lists with one ``scandir``, and metadata is asked of the OS;
    the reference is fsspec's own ``ls(detail=True)``, ``exists``, ``isfile``, ``isdir`` and
    ``size``: files, folders, links (to a file, to a folder, dangling) and a FIFO, a linked
    root, a root that is a file, and a missing one."""
    import os

    from fsspec.implementations.local import LocalFileSystem

    root = tmp_path / "root"
    (root / "step-1").mkdir(parents=True)
    (root / "step-1" / "a.safetensors").write_bytes(b"x" * 1000)
    (root / "f.json").write_bytes(b"{}")
    (root / "to-file").symlink_to(root / "f.json")
    (root / "to-dir").symlink_to(root / "step-1")
    (root / "dangling").symlink_to(root / "nowhere")
    os.mkfifo(root / "fifo")
    (tmp_path / "linked").symlink_to(root)

    fs = LocalFileSystem()

    def reference(path: pathlib.Path) -> dict[str, tuple[str, int]]:
        try:
            entries = fs.ls(str(path), detail=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: (e["type"], int(e["size"] or 0))
            for e in entries
        }

    for where, rel in [
        (root, ""),
        (root, "step-1"),
        (tmp_path / "linked", ""),
        (root / "f.json", ""),
        (root, "missing"),
    ]:
        got = Store(str(where), None).listdir(rel)
        assert got == reference(where / rel if rel else where), (where, rel)
    assert Store(str(root), None).listdir()["to-file"] == ("other", 2)

    def answers(ask: Any, path: str) -> Any:
        try:
            return ask(path)
        except FileNotFoundError:
            return "absent"

    store = Store(str(root), None)  # exists / isfile / isdir / size ask the OS: same answers
    for rel in ["", "step-1", "step-1/a.safetensors", "f.json", "to-file", "to-dir", "dangling",
                "fifo", "missing"]:  # fmt: skip
        path = str(root / rel) if rel else str(root)
        mine = [answers(f, rel) for f in (store.exists, store.isfile, store.isdir, store.size)]
        theirs = [answers(f, path) for f in (fs.exists, fs.isfile, fs.isdir, fs.size)]
        assert mine == theirs, rel


def test_inside_root_agrees_with_resolving_both_paths(tmp_path: pathlib.Path) -> None:
    """The reference is the definition: ``realpath`` of the path within ``realpath`` of the
    root. Links inside and out, ``..``, missing names, and a root that is itself a link."""
    import os

    real = tmp_path / "real"
    (real / "step-1").mkdir(parents=True)
    (real / "step-1" / "a").write_bytes(b"a")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x").write_bytes(b"x")
    (real / "step-1" / "in").symlink_to(real / "step-1" / "a")
    (real / "step-1" / "out").symlink_to(tmp_path / "outside" / "x")
    (real / "step-2").symlink_to(tmp_path / "outside")
    (real / "step-3").symlink_to(real / "step-1")
    (tmp_path / "alias").symlink_to(real)
    rels = [
        "",
        "step-1",
        "step-1/a",
        "step-1/in",
        "step-1/out",
        "step-2/x",
        "step-2/missing",
        "step-3/a",
        "step-3/out",
        "missing/a",
        "step-1/../step-1/a",
        "../outside/x",
        "step-1/..",
        "step-1/../..",
        "./step-1//a",
    ]
    for root in (real, tmp_path / "alias"):
        store = Store(str(root), None)
        resolved = os.path.realpath(root)
        for rel in rels:
            want = os.path.commonpath([resolved, os.path.realpath(store.full(rel))]) == resolved
            assert store.inside_root(rel) == want, (root, rel)


def test_a_child_forked_while_a_store_property_is_computed_does_not_hang(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store's lazily computed properties (``tmpfs``, ``_private``) take no lock: before
    Python 3.12 ``functools.cached_property`` holds one lock for every instance, and a child
    forked while another thread computed one waited on it for good at its own first use (a
    forked child's save hung)."""
    import os
    import signal
    import threading

    from ftsdp.storage.io import _local

    started, go, real = threading.Event(), threading.Event(), _local._mount_type

    def slow(path: str) -> str:
        started.set()
        go.wait(10)
        return real(path)

    monkeypatch.setattr(_local, "_mount_type", slow)
    t = threading.Thread(target=lambda: Store(str(tmp_path / "a"), None).tmpfs)
    t.start()
    assert started.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if its own store answers
        signal.alarm(10)
        _local._mount_type = real
        code = 1
        try:
            Store(str(tmp_path / "b"), None).tmpfs  # noqa: B018
            code = 0
        finally:
            os._exit(code)
    go.set()
    t.join()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
