"""``ftsdp-ckpt convert`` / ``reshard`` in process: bitwise round trips through every format, the
hf index, dtype / model-only / rename, S3 on both ends, and interrupted conversions; a DCP export
is read back, every key, by torch's own ``dcp.load``."""

from __future__ import annotations

import io
import json
import logging
import pathlib
import re
import warnings
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ftsdp import storage
from ftsdp.tools.ckpt import main

SMALL = storage.SaveOptions(checksum_block_bytes=64, object_bytes=6000)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(40, 30, generator=g),
            "b": torch.randn(30, generator=g).to(torch.bfloat16),
            "idx": torch.arange(12, dtype=torch.int64).reshape(3, 4),
            "mask": torch.rand(5, generator=g) > 0.5,
            "empty": torch.zeros(0, 3),
            "scale": torch.tensor(3.5),
        },
        "optim": {"exp_avg": torch.randn(40, 30, generator=g), "step": torch.tensor(17.0)},
        "trainer": {"step": 17, "tags": ["a", None]},
    }


def _flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        name = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(_flat(v, name))
        elif isinstance(v, torch.Tensor):
            out[name] = v
    return out


def _same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


# hf output is a model export by default (docs/cli.md); these flags keep everything as saved.
_AS_SAVED = {"hf": ["--include-optimizer", "--keep-names"]}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def src(tmp_path: pathlib.Path) -> str:
    url = str(tmp_path / "src")
    storage.save(_state(), url, step=17, options=SMALL)
    return url


@pytest.mark.parametrize("fmt", ["hf", "dcp", "torch"])
def test_round_trip_is_bitwise(src: str, tmp_path: pathlib.Path, fmt: str) -> None:
    mid = str(tmp_path / ("mid.pt" if fmt == "torch" else "mid"))
    assert _cli("convert", src, mid, "--to", fmt, *_AS_SAVED.get(fmt, []), "-q")[0] == 0
    assert storage.conversion.detect_format(mid) == fmt
    back = str(tmp_path / "back")
    code, out, _ = _cli("convert", mid, back, "--to", "ftsdp", "--dst-step", "17")
    assert code == 0 and f"from a {fmt} checkpoint" in out
    _same(storage.load_state_dict(back), _flat(_state()))
    assert storage.catalog.read_manifest(back).values == {
        "trainer.step": 17,
        "trainer.tags": ["a", None],
    }
    if fmt == "torch":  # a plain torch.save file of the flat state dict
        _same(
            {
                k: v
                for k, v in torch.load(mid, weights_only=True).items()
                if isinstance(v, torch.Tensor)
            },
            _flat(_state()),
        )
    if fmt == "dcp":
        _same_through_dcp(mid, _state())


@pytest.mark.parametrize("fmt", ["hf", "dcp", "torch", "ftsdp"])
def test_a_tensor_named_by_the_empty_string_converts(tmp_path: pathlib.Path, fmt: str) -> None:
    """``storage.save`` and safetensors hold a tensor named ``""``; conversions once refused it
    ("renaming '' leaves an empty name") with no ``--rename`` given."""
    src = str(tmp_path / "src")
    state = {"": torch.arange(3.0), "x": torch.zeros(2)}
    storage.save(state, src, 1)
    mid = str(tmp_path / ("mid.pt" if fmt == "torch" else "mid"))
    code, _, err = _cli("convert", src, mid, "--to", fmt, *_AS_SAVED.get(fmt, []), "-q")
    assert code == 0, err
    _same(storage.load_state_dict(mid), state)


def test_a_tensor_named_like_the_safetensors_header_key_is_refused_for_hf(
    tmp_path: pathlib.Path,
) -> None:
    """A tensor named ``__metadata__`` (any other format holds it) would overwrite the
    safetensors header's own key: the export wrote a file neither safetensors nor ftsdp could
    read, and said it succeeded. Refused before anything is written; ``--rename`` gets it out."""
    src = str(tmp_path / "src")
    state = {"__metadata__": torch.arange(3.0), "x": torch.zeros(2)}
    storage.save(state, src, 1)
    out = tmp_path / "hf"
    code, _, err = _cli("convert", src, str(out), "--to", "hf", *_AS_SAVED["hf"], "-q")
    assert code == 2 and "'__metadata__' cannot be written to safetensors" in err, err
    assert not out.exists() or not any(out.iterdir())
    code, _, err = _cli(
        "convert", src, str(out), "--to", "hf", *_AS_SAVED["hf"], "-q",
        "--rename", "__metadata__=meta",
    )  # fmt: skip
    assert code == 0, err
    _same(storage.load_state_dict(str(out)), {"meta": state["__metadata__"], "x": state["x"]})


def _same_through_dcp(path: str, state: dict[str, Any]) -> None:
    """``dcp.load`` (torch's reader, one process) reads EVERY key of ``state`` back from the DCP
    checkpoint at ``path``, equal to ``state``: tensors of each dtype, shape (empty, 0-d) and
    value, and the non-tensor values. DCP's own metadata lists exactly those keys, with their
    dtypes and shapes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    flat = _flat(state)
    values = {
        f"{group}.{k}": v
        for group, d in state.items()
        for k, v in d.items()
        if not isinstance(v, torch.Tensor)
    }
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert sorted(metadata) == sorted([*flat, *values])
    for name, t in flat.items():
        assert (metadata[name].properties.dtype, tuple(metadata[name].size)) == (t.dtype, t.shape)
    assert all(isinstance(metadata[name], BytesStorageMetadata) for name in values)

    def sentinel(t: torch.Tensor) -> torch.Tensor:
        """A target of ``t``'s dtype and shape that holds none of its elements."""
        other = ~t if t.dtype == torch.bool else t + 1
        assert (other != t).all(), t
        return other

    target = {
        group: {k: sentinel(v) if isinstance(v, torch.Tensor) else None for k, v in d.items()}
        for group, d in state.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(target, checkpoint_id=path, no_dist=True)
    _same(_flat(target), flat)
    got_values = {
        f"{group}.{k}": v
        for group, d in target.items()
        for k, v in d.items()
        if not isinstance(v, torch.Tensor)
    }
    assert got_values == values


def test_dcp_export_of_several_row_blocks_reads_back_with_dcp_load(tmp_path: pathlib.Path) -> None:
    """A tensor larger than the conversion's chunk is written as several row blocks (DCP's own
    shards); ``dcp.load`` reassembles it and every other key, exactly."""
    state = _state()
    g = torch.Generator().manual_seed(1)
    state["model"]["big"] = torch.randn(700, 1000, generator=g)  # 2.8 MB: three 1 MiB blocks
    state["model"]["big_bf16"] = torch.randn(1100, 700, generator=g).bfloat16()  # two blocks
    storage.save(state, str(tmp_path / "src"), step=3)
    dst = str(tmp_path / "dcp")
    storage.conversion.convert(
        str(tmp_path / "src"), dst, to="dcp", max_memory=8 << 20
    )  # 1 MiB chunks
    import torch.distributed.checkpoint as dcp

    chunks = dcp.FileSystemReader(dst).read_metadata().state_dict_metadata["model.big"].chunks
    assert len(chunks) == 3, chunks
    _same_through_dcp(dst, state)


def test_hf_shards_and_index(src: str, tmp_path: pathlib.Path) -> None:
    dst = tmp_path / "hf"
    argv = ["convert", src, str(dst), "--to", "hf", *_AS_SAVED["hf"], "--max-shard-size", "5000"]
    assert _cli(*argv, "-q")[0] == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    ref = _flat(_state())
    assert sorted(index["weight_map"]) == sorted(ref)  # every tensor exactly once (a dict)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and sorted(p.name for p in dst.glob("*.safetensors")) == files
    loaded: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(dst / f))
        assert not set(part) & set(loaded)
        loaded.update(part)
    _same(loaded, ref)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in ref.values()
    )
    # One file when no size is given.
    assert _cli("convert", src, str(tmp_path / "one"), "--to", "hf", *_AS_SAVED["hf"], "-q")[0] == 0
    _same(load_file(str(tmp_path / "one" / "model.safetensors")), ref)


def test_dtype_model_only_rename(src: str, tmp_path: pathlib.Path) -> None:
    dst = tmp_path / "bf16"
    argv = [
        "convert",
        src,
        str(dst),
        "--to",
        "hf",
        "--dtype",
        "bf16",
        "--model-only",
        "--rename",
        "model.=",
    ]
    assert _cli(*argv, "-q")[0] == 0
    got = load_file(str(dst / "model.safetensors"))
    model = _state()["model"]
    assert sorted(got) == sorted(model)  # optimizer state dropped, prefix stripped
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], model["w"].bfloat16())
    assert got["idx"].dtype == torch.int64 and got["mask"].dtype == torch.bool  # only floats cast
    assert storage.LazyStateDict(str(dst)).values == {}  # --model-only drops non-tensor values


def test_hf_default_is_the_model_weights(src: str, tmp_path: pathlib.Path) -> None:
    """No flag: the tensors under ``model.`` without the prefix, no values, and a note that
    there is no recorded config; a --rename rule comes before the prefix strip."""
    code, out, _ = _cli("convert", src, str(tmp_path / "hf"), "--to", "hf", "-q")
    assert code == 0 and "note: " in out and "no config.json" in out
    assert "from a ftsdp checkpoint (step 17)" in out  # which step was exported
    _same(load_file(str(tmp_path / "hf" / "model.safetensors")), _state()["model"])
    assert storage.LazyStateDict(str(tmp_path / "hf")).values == {}
    argv = ["convert", src, str(tmp_path / "r"), "--to", "hf", "--rename", "model.w=model.w2", "-q"]
    assert _cli(*argv)[0] == 0
    got = load_file(str(tmp_path / "r" / "model.safetensors"))
    assert sorted(got) == sorted({*_state()["model"], "model.w2"} - {"w"})


def test_reshard_lays_out_for_world_size(src: str, tmp_path: pathlib.Path) -> None:
    dst = str(tmp_path / "w3")
    code, out, _ = _cli("reshard", src, dst, "--world-size", "3", "-q")
    assert code == 0 and "world size 3" in out
    manifest = storage.catalog.read_manifest(dst)
    assert manifest.world_size == 3 and manifest.step == 17
    w = manifest.tensors["model.w"]
    assert sorted(p.offset for p in w.pieces) == [0, 400, 800]
    assert len({p.object.split("-")[0] for p in w.pieces}) == 3  # one writer per rank
    _same(storage.load_state_dict(dst), _flat(_state()))
    # Loaded as two ranks' flat ranges, straight from the 3-rank layout.
    half = storage.FlatShard((40, 30), 600, torch.zeros(600))
    storage.load({"model": {"w": half}}, dst, strict=False)
    assert torch.equal(half.local, _state()["model"]["w"].reshape(-1)[600:])


def test_s3_source_and_destination(
    src: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest
) -> None:
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket_url")
    opts = [f"--storage-option={k}={v}" for k, v in endpoint.items()]
    assert _cli("convert", src, bucket, "--to", "ftsdp", *opts, "-q")[0] == 0
    hf_url = bucket.replace("/ckpt", "/hf")
    assert (
        _cli(
            "convert",
            bucket,
            hf_url,
            "--to",
            "hf",
            *_AS_SAVED["hf"],
            "--max-shard-size",
            "6000",
            *opts,
            "-q",
        )[0]
        == 0
    )
    assert _cli("convert", hf_url, str(tmp_path / "back"), "--to", "ftsdp", *opts, "-q")[0] == 0
    _same(storage.load_state_dict(str(tmp_path / "back")), _flat(_state()))
    code, out, _ = _cli("verify", bucket, *opts)
    assert code == 0 and out.startswith("OK")


@pytest.mark.parametrize("fmt", ["ftsdp", "hf", "torch", "dcp"])
def test_interrupted_convert_never_looks_complete(
    src: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The feed stops after a few tensors (deterministically, as ^C would): the destination must
    not read as a checkpoint, and a later convert into it succeeds without --overwrite."""
    from ftsdp.storage.conversion._interfaces import Feed

    real, served = Feed.stream, []

    def failing(self: Any, requests: Any) -> Any:
        for chunk in real(self, requests):
            served.append(1)
            if len(served) == 4:
                raise KeyboardInterrupt
            yield chunk

    monkeypatch.setattr(Feed, "stream", failing)
    dst = str(tmp_path / ("out.pt" if fmt == "torch" else "out"))
    argv = ["convert", src, dst, "--to", fmt, "--max-memory", "8MiB", "-q"]
    if fmt == "hf":
        argv += ["--max-shard-size", "3000", *_AS_SAVED["hf"]]
    code, _, err = _cli(*argv)
    assert code == 130 and "interrupted" in err
    with pytest.raises((storage.CheckpointError, ValueError)):
        storage.load_state_dict(dst)
    monkeypatch.setattr(Feed, "stream", real)
    assert _cli(*argv)[0] == 0
    _same(storage.load_state_dict(dst), _flat(_state()))


@pytest.mark.parametrize("writer", ["save", "convert"])
def test_convert_commits_through_the_save_protocol(
    src: str,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    writer: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``save`` and the converter's ftsdp output commit through the same code: a failure writing
    the manifest leaves no committed step and no ``latest`` (and a save none of its objects);
    a failure after it (``latest``) is a warning and the step is committed."""
    from ftsdp.storage.io._fs import Store

    real, fail = Store._write_once, {"name": "manifest.json"}

    def write(self: Store, rel: str, produce: Any) -> None:
        if rel.rsplit("/", 1)[-1] == fail["name"]:
            raise PermissionError(f"injected: cannot write {rel}")
        real(self, rel, produce)

    monkeypatch.setattr(Store, "_write_once", write)
    dst = tmp_path / "dst"

    def run() -> None:
        if writer == "save":
            storage.save(_state(), str(dst), step=17, options=SMALL)
        else:
            storage.conversion.convert(src, str(dst), to="ftsdp", world_size=2, object_bytes=6000)

    with pytest.raises(PermissionError, match="manifest.json"):
        run()
    assert storage.list_steps(str(dst)) == [] and not (dst / "latest").exists()
    torn = list(dst.glob("step-*/*.safetensors"))
    if writer == "save":  # a failed save removes its objects
        assert torn == []
    else:  # a torn attempt, which readers ignore
        assert torn
    fail["name"] = "latest"
    # An operational event, logged (not a warnings.warn: it may come from a background save).
    with caplog.at_level(logging.WARNING, logger="ftsdp.storage.saving._commit"):
        run()
    assert re.search(r"step 17 committed at .*, but updating 'latest'", caplog.text), caplog.text
    assert storage.list_steps(str(dst)) == [17] and not (dst / "latest").exists()
    assert not list(dst.glob("step-17/_done-*"))
    _same(storage.load_state_dict(str(dst)), _flat(_state()))
