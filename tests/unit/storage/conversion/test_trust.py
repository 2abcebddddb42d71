"""A checkpoint is input from outside (docs/format.md, "Threat model"): reading one never runs
code from it, a conversion never clears or overwrites its own source nor deletes files it did not
write, and no pointer inside a checkpoint leads out of it.

Each test below failed before the fix it covers: a DCP ``.metadata`` pickle ran its payload in
every reader (and beside an ftsdp root), ``convert`` deleted its source when the two URLs spelled
one place differently, the hf and DCP writers' ``--overwrite`` removed every ``.safetensors`` /
``.distcp`` file in the destination, and an hf index, a DCP ``relative_path`` or a torch file's
storage could point outside the checkpoint (or its record).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pathlib
import pickle
import socket
import warnings
import zipfile
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
        "trainer": {"step": 3},
    }


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(6, 4))
        self.b = torch.nn.Parameter(torch.zeros(4))


class _Payload:
    """Unpickling it calls ``fn(marker)``: the code a hostile pickle runs."""

    def __init__(self, fn: Any, marker: pathlib.Path) -> None:
        self.fn, self.marker = fn, marker

    def __reduce__(self) -> tuple:
        if self.fn is open:
            return (open, (str(self.marker), "w"))
        return (self.fn, (str(self.marker),))


def _dcp(tmp_path: pathlib.Path, name: str = "dcp") -> pathlib.Path:
    src = tmp_path / "src"
    if not src.exists():
        storage.save(_state(), str(src), step=3)
    storage.conversion.convert(str(src), str(tmp_path / name), to="dcp")
    return tmp_path / name


def _metadata(folder: pathlib.Path) -> Any:
    from ftsdp.storage.conversion._dcp import unpickle_metadata

    return unpickle_metadata((folder / ".metadata").read_bytes())


def _readers(url: str, **kwargs: Any) -> dict[str, Any]:
    """Every entry point that opens a checkpoint, as a zero-argument call."""
    out = str(pathlib.Path(url).parent / "converted")
    return {
        "load_state_dict": lambda: storage.load_state_dict(url, **kwargs),
        "LazyStateDict": lambda: storage.LazyStateDict(url, **kwargs).close(),
        "load_into": lambda: storage.load_into(_Model(), url, prefix="model.", **kwargs),
        "inspect": lambda: storage.catalog.inspect_checkpoint(url, **kwargs),
        "verify": lambda: storage.catalog.verify(url, **kwargs),
        "diff": lambda: storage.catalog.diff(url, None, url, None, **kwargs),
        "convert": lambda: storage.conversion.convert(url, out, to="hf", overwrite=True, **kwargs),
    }


# -- 1. no code runs from a pickle ----------------------------------------------------------------


@pytest.mark.parametrize("fn", [os.mkdir, open], ids=["os.mkdir", "open"])
def test_a_hostile_dcp_metadata_runs_nothing(tmp_path: pathlib.Path, fn: Any) -> None:
    """A valid-looking DCP checkpoint whose ``.metadata`` also carries a payload: every reader and
    every CLI command refuses it with UnsafeCheckpointError (exit 2 naming --trust-pickle), and
    the payload never ran."""
    folder = _dcp(tmp_path)
    marker = tmp_path / "PWNED"
    metadata = _metadata(folder)
    metadata.planner_data = _Payload(fn, marker)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    for name, read in _readers(str(folder)).items():
        with pytest.raises(storage.UnsafeCheckpointError, match="refusing to unpickle") as e:
            read()
        assert "trust_pickle=True" in str(e.value), name
        assert not marker.exists(), name
    for argv in (["inspect"], ["verify"], ["convert", "--to", "hf", str(tmp_path / "o")]):
        code, _, err = _cli(argv[0], str(folder), *argv[1:])
        assert code == 2 and "--trust-pickle" in err and "refusing to unpickle" in err, err
    assert not marker.exists()


def test_a_metadata_beside_an_ftsdp_root_is_never_read(tmp_path: pathlib.Path) -> None:
    """A root with committed steps is an ftsdp checkpoint whatever else lies in it: the
    ``.metadata`` planted there is not even read, and every reader reads the steps."""
    root = tmp_path / "root"
    storage.save(_state(), str(root), step=3)
    marker = tmp_path / "PWNED"
    (root / ".metadata").write_bytes(pickle.dumps(_Payload(os.mkdir, marker)))
    assert storage.conversion.detect_format(str(root)) == "ftsdp"
    for name, read in _readers(str(root)).items():
        read()
        assert not marker.exists(), name
    assert torch.equal(storage.load_state_dict(str(root))["model.w"], _state()["model"]["w"])
    code, out, _ = _cli("inspect", str(root))
    assert code == 0 and out.startswith("ftsdp checkpoint")
    assert _cli("verify", str(root))[0] == 0
    assert _cli("convert", str(root), str(tmp_path / "hf"), "--to", "hf", "-q")[0] == 0
    assert not marker.exists()
    # A torn root (step dirs, nothing committed) is still ftsdp: refused without reading it.
    torn = tmp_path / "torn"
    (torn / "step-5").mkdir(parents=True)
    (torn / ".metadata").write_bytes(pickle.dumps(_Payload(os.mkdir, marker)))
    with pytest.raises(storage.CheckpointNotFoundError, match="no committed step"):
        storage.load_state_dict(str(torn))
    assert not marker.exists()


def test_what_torch_writes_passes_the_restricted_unpickler(tmp_path: pathlib.Path) -> None:
    """``.metadata`` as torch's own ``dcp.save`` writes it (nested state, several dtypes, scalars,
    optimizer-like state, a ``pathlib`` checkpoint id) loads without ``trust_pickle``; a tensor
    inside it (``torch._utils._rebuild_tensor_v2``: a function call) does not."""
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {
            "w": torch.randn(5, 3),
            "h": torch.ones(4, dtype=torch.bfloat16),
            "i": torch.arange(6).reshape(2, 3),
            "m": torch.tensor([True, False]),
            "s": torch.tensor(2.5),
        },
        "optim": {"state": {"0": {"exp_avg": torch.zeros(5, 3), "step": torch.tensor(4.0)}}},
        "step": 7,
        "lr": 0.5,
        "tags": ["a", {"b": (1, 2)}],
    }
    folder = tmp_path / "torch-dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
        dcp.save(state, checkpoint_id=folder, no_dist=True)  # a Path: pickled as PosixPath
    got = storage.load_state_dict(str(folder))
    assert torch.equal(got["model.h"], state["model"]["h"])
    assert torch.equal(got["optim.state.0.exp_avg"], state["optim"]["state"]["0"]["exp_avg"])
    with storage.LazyStateDict(str(folder)) as ckpt:
        assert ckpt.values["step"] == 7 and ckpt.values["lr"] == 0.5

    from torch.distributed.checkpoint.metadata import Metadata

    assert isinstance(_metadata(folder), Metadata)
    metadata = _metadata(folder)
    metadata.planner_data = torch.zeros(2)  # pickled by a call of torch._utils._rebuild_tensor_v2
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(storage.UnsafeCheckpointError, match="torch._utils._rebuild_tensor_v2"):
        storage.load_state_dict(str(folder))


def test_trust_pickle_opts_in(tmp_path: pathlib.Path) -> None:
    """A class DCP's metadata is not made of is refused by default; ``trust_pickle=True`` and
    ``--trust-pickle`` on every command that reads admit it."""
    folder = _dcp(tmp_path)
    metadata = _metadata(folder)
    metadata.planner_data = {"saved": datetime.date(2024, 1, 2)}  # harmless, but not admitted
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(storage.UnsafeCheckpointError, match="datetime.date"):
        storage.load_state_dict(str(folder))
    for read in _readers(str(folder), trust_pickle=True).values():
        read()
    got = storage.load_state_dict(str(folder), trust_pickle=True)
    assert torch.equal(got["model.w"], _state()["model"]["w"])
    url = str(folder)
    assert _cli("inspect", url)[0] == 2
    for argv in (
        ["inspect", url],
        ["verify", url],
        ["diff", url, "0", "0"],
        ["convert", url, str(tmp_path / "a"), "--to", "ftsdp"],
        ["reshard", url, str(tmp_path / "b"), "--world-size", "2"],
    ):
        code, _, err = _cli(*argv, "--trust-pickle", "-q")
        assert code == 0 or "has no steps" in err, (argv, err)  # diff takes steps: ftsdp only


# -- 5. a conversion never clears its own source, and deletes only what it wrote ------------------


def _steps(root: pathlib.Path) -> list[str]:
    return sorted(p.parent.name for p in root.glob("step-*/manifest.json"))


def test_convert_refuses_one_place_spelled_two_ways(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``file://``, a relative path, a symlink, a destination inside the source and a source
    file inside the destination are all refused before anything is touched."""
    root = tmp_path / "R"
    storage.save(_state(), str(root), step=1)
    storage.save(_state(), str(root), step=2)
    (tmp_path / "link").symlink_to(root)
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "D"
    storage.conversion.convert(str(root), str(hf), to="hf")
    cases = [
        (f"file://{root}", str(root), "ftsdp", "same location"),
        (str(root), "R", "ftsdp", "same location"),
        (str(tmp_path / "link"), str(root), "ftsdp", "same location"),
        (str(root), str(root / "sub"), "hf", "lies inside the source"),
        (str(root / "step-2"), str(root), "ftsdp", "lies inside the destination"),
        (str(hf / "model.safetensors"), str(hf), "hf", "lies inside the destination"),
        (str(hf / "model.safetensors"), f"file://{hf}/", "hf", "lies inside the destination"),
    ]
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for src, dst, to, message in cases:
        with pytest.raises(ValueError, match=message):
            storage.conversion.convert(src, dst, to=to, overwrite=True)
        code, _, err = _cli("convert", src, dst, "--to", to, "--overwrite", "-q")
        assert code == 2 and message in err, (src, dst, err)
    assert _cli("reshard", f"file://{root}", str(root), "--world-size", "2", "--overwrite")[0] == 2
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written or removed
    assert _steps(root) == ["step-1", "step-2"]
    # Siblings with a common prefix are different places.
    storage.conversion.convert(str(root), str(tmp_path / "R2"), to="ftsdp")


def test_convert_refuses_s3_and_s3a_of_one_place(
    tmp_path: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    endpoint = request.getfixturevalue("s3_endpoint")
    url = request.getfixturevalue("s3_bucket_url")
    storage.save(_state(), url, step=3, storage_options=endpoint)
    for dst, why in (
        (url.replace("s3://", "s3a://"), "same location"),
        (url + "/", "same location"),
        # a server may fold '//' or keep it: such a prefix is refused wherever it is given
        (url.replace("/ckpt", "//ckpt/."), "empty path segment"),
    ):
        with pytest.raises(ValueError, match=why):
            storage.conversion.convert(
                url, dst, to="ftsdp", overwrite=True, storage_options=endpoint
            )
    with pytest.raises(ValueError, match="lies inside the source"):
        storage.conversion.convert(
            url, url + "/hf", to="hf", overwrite=True, storage_options=endpoint
        )
    assert storage.list_steps(url, storage_options=endpoint) == [3]
    assert storage.catalog.verify(url, storage_options=endpoint).ok


@pytest.fixture(params=["local", "s3"])
def dst_url(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> tuple[str, dict | None]:
    if request.param == "local":
        return str(tmp_path / "dst"), None
    return request.getfixturevalue("s3_bucket_url") + "/dst", request.getfixturevalue("s3_endpoint")


def _put(url: str, opts: dict | None, name: str, data: bytes) -> None:
    from ftsdp.storage.io._fs import Store

    Store(url, opts).write_bytes(name, data)


def _names(url: str, opts: dict | None) -> dict[str, bytes]:
    from ftsdp.storage.io._fs import Store

    store = Store(url, opts)
    return {n: store.read(n) for n, (kind, _) in store.listdir().items() if kind == "file"}


def test_hf_overwrite_removes_only_its_own_files(
    tmp_path: pathlib.Path, dst_url: tuple[str, dict | None]
) -> None:
    """``--overwrite`` of an hf folder removes the index and the files it lists, nothing else; a
    file the writer is about to write that it did not write is refused without ``overwrite``."""
    url, opts = dst_url
    src = tmp_path / "src"
    storage.save(_state(), str(src), step=3)
    storage.conversion.convert(str(src), url, to="hf", max_shard_bytes=40, storage_options=opts)
    listed = set(
        json.loads(_names(url, opts)["model.safetensors.index.json"])["weight_map"].values()
    )
    assert len(listed) == 2
    mine = {
        "notes.safetensors": b"the user's own",
        "model-00007-of-00009.safetensors": b"shard-named, no index lists it",
        "README.md": b"hello",
    }
    for name, data in mine.items():
        _put(url, opts, name, data)
    storage.conversion.convert(
        str(src), url, to="hf", overwrite=True, storage_options=opts
    )  # one file now
    after = _names(url, opts)
    assert {n: after[n] for n in mine} == mine  # untouched
    assert "model.safetensors" in after and not listed & set(after)
    assert "model.safetensors.index.json" not in after and ".ftsdp-writing.json" not in after
    got = storage.load_state_dict(url, storage_options=opts)
    assert torch.equal(got["model.w"], _state()["model"]["w"])

    # A file of a name it is about to write, which it did not write: refused, kept.
    other = url + "2"
    _put(other, opts, "model-00001-of-00002.safetensors", b"not ours")
    with pytest.raises(FileExistsError, match="did not write"):
        storage.conversion.convert(
            str(src), other, to="hf", max_shard_bytes=40, storage_options=opts
        )
    assert _names(other, opts) == {"model-00001-of-00002.safetensors": b"not ours"}
    storage.conversion.convert(
        str(src), other, to="hf", max_shard_bytes=40, overwrite=True, storage_options=opts
    )  # replaced, as docs/cli.md says
    assert len(storage.load_state_dict(other, storage_options=opts)) == 2


def test_dcp_overwrite_removes_only_what_its_metadata_lists(tmp_path: pathlib.Path) -> None:
    folder = _dcp(tmp_path)
    ours = {info.relative_path for info in _metadata(folder).storage_data.values()}
    (folder / "__9_9.distcp").write_bytes(b"not listed by .metadata")
    (folder / "notes.txt").write_bytes(b"the user's")
    storage.conversion.convert(str(tmp_path / "src"), str(folder), to="dcp", overwrite=True)
    assert (folder / "__9_9.distcp").read_bytes() == b"not listed by .metadata"
    assert (folder / "notes.txt").exists() and not (folder / ".ftsdp-writing.json").exists()
    assert ours == {info.relative_path for info in _metadata(folder).storage_data.values()}
    # The writer's own item names, present but not its own: refused without overwrite.
    other = tmp_path / "other"
    other.mkdir()
    (other / "__0_0.distcp").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError, match="did not write"):
        storage.conversion.convert(str(tmp_path / "src"), str(other), to="dcp")
    assert (other / "__0_0.distcp").read_bytes() == b"someone else's"


def test_an_interrupted_write_is_finished_and_its_leftovers_removed(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files an interrupted hf write left are its own (its record lists them): a later write
    of another shard count replaces or removes them, without overwrite, and no record stays."""
    from ftsdp.storage.conversion._interfaces import Feed

    src = tmp_path / "src"
    storage.save({n: torch.full((4,), float(i)) for i, n in enumerate("abc")}, str(src), step=3)
    real, served = Feed.stream, []

    def failing(self: Any, requests: Any) -> Any:
        for chunk in real(self, requests):
            served.append(1)
            if len(served) == 2:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(Feed, "stream", failing)
    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        storage.conversion.convert(str(src), str(dst), to="hf", max_shard_bytes=16)  # three shards
    left = sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert left == ["model-00001-of-00003.safetensors"] and (dst / ".ftsdp-writing.json").exists()
    monkeypatch.setattr(Feed, "stream", real)
    storage.conversion.convert(str(src), str(dst), to="hf", max_shard_bytes=40)  # two shards
    assert sorted(p.name for p in dst.iterdir()) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]


def test_a_write_still_running_into_the_folder_is_not_taken_for_an_interrupted_one(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two conversions into one folder: the record of a process still running on this host
    makes the second refuse (it would delete the first one's files as leftovers); once that
    process is gone the record is an interrupted write's. A write whose record another write
    took over does not write its index over the other's files."""
    import subprocess
    import sys

    from ftsdp.storage.conversion._interfaces import Feed

    src, dst = tmp_path / "src", tmp_path / "dst"
    storage.save({n: torch.full((4,), float(i)) for i, n in enumerate("abc")}, str(src), step=3)
    record = dst / ".ftsdp-writing.json"
    dst.mkdir()
    (dst / "model-00001-of-00003.safetensors").write_bytes(b"the other write's shard")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owner = {"token": "other", "host": socket.gethostname(), "pid": other.pid}
        files = ["model-00001-of-00003.safetensors"]
        record.write_text(json.dumps({"files": files, "owner": owner}))
        with pytest.raises(FileExistsError, match=f"process {other.pid} on this machine"):
            storage.conversion.convert(str(src), str(dst), to="hf", max_shard_bytes=40)
        assert (dst / files[0]).read_bytes() == b"the other write's shard"
    finally:
        other.kill()
        other.wait()
    storage.conversion.convert(str(src), str(dst), to="hf", max_shard_bytes=40)  # gone: taken over
    assert not record.exists() and not (dst / files[0]).exists()

    real = Feed.stream
    taken = tmp_path / "taken"

    def taken_over(self: Any, requests: Any) -> Any:
        if taken.is_dir() and (taken / ".ftsdp-writing.json").exists():
            rec = json.loads((taken / ".ftsdp-writing.json").read_text())
            rec["owner"]["token"] = "another writer"
            (taken / ".ftsdp-writing.json").write_text(json.dumps(rec))
        yield from real(self, requests)

    monkeypatch.setattr(Feed, "stream", taken_over)
    with pytest.raises(storage.CheckpointError, match="took it over"):
        storage.conversion.convert(str(src), str(taken), to="hf", max_shard_bytes=40)
    assert not (taken / "model.safetensors.index.json").exists()
    taken = tmp_path / "taken-dcp"
    with pytest.raises(storage.CheckpointError, match="took it over"):
        storage.conversion.convert(str(src), str(taken), to="dcp")
    assert not (taken / ".metadata").exists()


def test_a_write_record_of_a_process_number_now_reused_is_an_interrupted_write(
    tmp_path: pathlib.Path,
) -> None:
    """The process that wrote the record died and its number now belongs to another process
    (one that started later): the record is an interrupted write's, not a live one."""
    import subprocess
    import sys

    from ftsdp.storage.conversion import _sinks

    src, dst = tmp_path / "src", tmp_path / "dst"
    storage.save({n: torch.full((4,), float(i)) for i, n in enumerate("abc")}, str(src), step=3)
    dst.mkdir()
    (dst / "model-00001-of-00003.safetensors").write_bytes(b"an interrupted write's shard")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = _sinks._started(other.pid)
        assert started is not None
        owner = {"token": "old", "host": socket.gethostname(), "pid": other.pid}
        files = ["model-00001-of-00003.safetensors"]
        record = {"files": files, "owner": {**owner, "started": started - 1}}
        (dst / ".ftsdp-writing.json").write_text(json.dumps(record))
        storage.conversion.convert(str(src), str(dst), to="hf", max_shard_bytes=40)
    finally:
        other.kill()
        other.wait()
    assert not (dst / files[0]).exists() and not (dst / ".ftsdp-writing.json").exists()


# -- 6. every pointer stays inside its checkpoint -------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../secret/x.safetensors",
        "/abs/x.safetensors",
        "sub/x.safetensors",
        "..\\x.safetensors",
        "x.safetensors\n",
        "s3://bucket/x.safetensors",
        "x\x00.safetensors",
        "..",
    ],
)
def test_an_hf_index_pointing_outside_is_refused(tmp_path: pathlib.Path, name: str) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    storage.save({"stolen": torch.arange(4.0)}, str(tmp_path / "s"), step=0)
    storage.conversion.convert(str(tmp_path / "s"), str(secret / "x.safetensors"), to="hf")
    storage.save({"other": torch.zeros(2)}, str(tmp_path / "o"), step=0)
    hf = tmp_path / "hf"
    storage.conversion.convert(str(tmp_path / "o"), str(hf), to="hf")
    index = {"metadata": {}, "weight_map": {"stolen": name, "other": "model.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    for read in (
        lambda: storage.load_state_dict(str(hf)),
        lambda: storage.conversion.convert(str(hf), str(tmp_path / "out"), to="ftsdp"),
    ):
        with pytest.raises(storage.CorruptCheckpointError, match="not plain file names"):
            read()
    assert not (tmp_path / "out").exists()


def test_a_dcp_relative_path_pointing_outside_is_refused(tmp_path: pathlib.Path) -> None:
    folder = _dcp(tmp_path)
    outside = _dcp(tmp_path, "secret")  # a DCP checkpoint beside it, whose items it names
    metadata = _metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = f"../{outside.name}/{info.relative_path}"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    for name, read in _readers(str(folder)).items():
        with pytest.raises(storage.CorruptCheckpointError, match="not a plain file name") as e:
            read()
        assert "../secret/" in str(e.value), name
    for info in metadata.storage_data.values():
        info.relative_path = str(outside / info.relative_path.rsplit("/", 1)[-1])  # absolute
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(storage.CorruptCheckpointError, match="not a plain file name"):
        storage.load_state_dict(str(folder))


def _torch_file_claiming_more_than_its_record(path: pathlib.Path) -> None:
    """A torch.save zip whose pickle says tensor ``a`` has 100 elements, while its storage record
    holds 10 (the bytes after it are another tensor's record)."""

    def saved(obj: dict) -> zipfile.ZipFile:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return zipfile.ZipFile(io.BytesIO(buf.getvalue()))

    big = saved({"a": torch.zeros(100)})
    small = saved({"a": torch.zeros(10), "pad": torch.full((200,), 7.0)})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name in small.namelist():
            pkl = name.endswith("/data.pkl")
            z.writestr(name, big.read("archive/data.pkl") if pkl else small.read(name))


def test_a_torch_storage_outside_its_record_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "crafted.pt"
    _torch_file_claiming_more_than_its_record(path)
    meta = torch.load(path, map_location="meta", weights_only=True)
    assert meta["a"].shape == (100,)  # torch's meta load does not check it
    with pytest.raises(storage.CorruptCheckpointError, match="inside its storage record"):
        storage.load_state_dict(str(path))
    code, _, err = _cli("convert", str(path), str(tmp_path / "out"), "--to", "hf")
    assert code == 2 and "inside its storage record" in err
    # A genuine file with views, empty and scalar tensors reads as before.
    good = {
        "v": torch.arange(12.0).reshape(3, 4)[:, 1],
        "t": torch.arange(6).reshape(2, 3).t(),
        "e": torch.zeros(0, 3),
        "s": torch.tensor(1.5),
    }
    torch.save(good, tmp_path / "good.pt")
    got = storage.load_state_dict(str(tmp_path / "good.pt"))
    assert all(torch.equal(got[k], v) for k, v in good.items())
