"""Checkpoints written by other libraries whose metadata lies, or whose structure ftsdp flattened
wrongly: each is built with the library that writes that format (DCP's ``dcp.save``,
``safetensors.torch.save_file``, ``torch.save``), then damaged the way a stale copy or an edited
file would be.

Each test below failed before the fix it covers: a DCP ``.metadata`` giving a tensor another
dtype (or shape) than its item holds returned the item's bytes reinterpreted, a truncated
``.distcp`` item raised a bare ``OSError``, an hf index naming tensors its shards do not hold (or
a shard that is gone) was accepted with fewer tensors, tensors in a list of dicts of a
``torch.save`` file were dropped, and two entries of one flattening to the same name kept one.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import warnings
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main


def _cli(*argv: str) -> tuple[int, str]:
    """Exit code and stdout + stderr of ``ftsdp-ckpt ARGV``."""
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue() + err.getvalue()


def _raises(exc_type: type[Exception], match: str, fn: Any) -> Exception:
    """The exception ``fn()`` raises, which must be exactly ``exc_type`` (no subclass) and
    whose message must contain ``match``."""
    with pytest.raises(exc_type) as info:
        fn()
    assert type(info.value) is exc_type, repr(info.value)
    assert match in str(info.value), str(info.value)
    return info.value


# -- DCP --------------------------------------------------------------------------------------------


def _dcp_save(state: dict[str, Any], folder: pathlib.Path, planner: Any = None) -> str:
    """``state`` saved by DCP itself, in one process (no process group)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), planner=planner, no_dist=True)
    return str(folder)


def _dcp_load(folder: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DCP's own reader loads into empty tensors shaped like ``like``."""
    import torch.distributed.checkpoint as dcp

    out = {k: torch.empty_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=folder, no_dist=True)
    return out


def _edit_metadata(folder: str, edit: Any) -> None:
    """Rewrite DCP's ``.metadata`` pickle with ``edit(metadata)`` applied."""
    path = pathlib.Path(folder) / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _w() -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).view(4, 3) + 0.5


@pytest.mark.parametrize("said", [torch.float64, torch.float16, torch.int32])
def test_dcp_metadata_dtype_other_than_its_item_is_read_as_dcp_reads_it(
    tmp_path: pathlib.Path, said: torch.dtype
) -> None:
    """DCP's reader loads an item whole and casts it into a tensor of the metadata's dtype: so
    does ftsdp (it read the item's raw bytes with the metadata's item size before)."""
    folder = _dcp_save({"w": _w(), "pad": torch.full((8,), 7.0)}, tmp_path / "dcp")

    def lie(metadata: Any) -> None:
        metadata.state_dict_metadata["w"].properties.dtype = said

    _edit_metadata(folder, lie)
    expected = _dcp_load(folder, {"w": torch.empty(4, 3, dtype=said)})["w"]
    assert torch.equal(expected, _w().to(said))  # DCP's own reading: a cast
    got = storage.load_state_dict(folder, keys=["w"])["w"]
    assert got.dtype == said and torch.equal(got, expected)
    report = storage.catalog.verify(folder)
    assert report.ok, report.problems


def test_dcp_planner_writing_another_dtype_than_its_metadata_loads_as_dcp_loads_it(
    tmp_path: pathlib.Path,
) -> None:
    """A save planner that converts what it writes (``resolve_data``, the hook torch's
    ``SavePlanner`` documents) and keeps the metadata's dtype: items of bfloat16 under float32
    metadata; DCP's reader casts them back, and so does ftsdp (it read past each item's storage
    record before)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    class Bf16OnDisk(dcp.DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            item = super().resolve_data(write_item)
            return item if write_item.type == WriteItemType.BYTE_IO else item.bfloat16()

    w = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    folder = _dcp_save({"w": w}, tmp_path / "dcp", planner=Bf16OnDisk())
    expected = _dcp_load(folder, {"w": w})["w"]
    assert expected.dtype == torch.float32 and torch.equal(expected, w.bfloat16().float())
    got = storage.load_state_dict(folder)["w"]
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert storage.catalog.verify(folder).ok


def test_dcp_metadata_shape_other_than_its_item_is_corrupt(tmp_path: pathlib.Path) -> None:
    """``.metadata`` says [3, 4] for an item holding [4, 3] (the same elements): DCP's reader
    refuses it, and so does ftsdp (it returned the bytes reshaped before)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    folder = _dcp_save({"w": _w()}, tmp_path / "dcp")

    def lie(metadata: Any) -> None:
        md = metadata.state_dict_metadata["w"]
        md.size = torch.Size([3, 4])
        md.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4]))]

    _edit_metadata(folder, lie)
    error = _raises(
        storage.CorruptCheckpointError,
        "elements saved, (3, 4) wanted",
        lambda: storage.load_state_dict(folder),
    )
    assert "fqn='w'" in str(error) and folder in str(error), str(error)
    report = storage.catalog.verify(folder)
    assert not report.ok and "tensor w:" in report.problems[0], report.problems


def _truncated_dcp(tmp_path: pathlib.Path) -> tuple[str, pathlib.Path]:
    """A DCP checkpoint of one tensor ``w`` and a value, its item file cut 2000 bytes short."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    folder = _dcp_save({"w": w, "step": 3}, tmp_path / "dcp")
    (item,) = pathlib.Path(folder).glob("*.distcp")
    with open(item, "r+b") as f:
        f.truncate(item.stat().st_size - 2000)
    return folder, item


def test_dcp_truncated_item_is_incomplete(tmp_path: pathlib.Path) -> None:
    folder, item = _truncated_dcp(tmp_path)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(64, 64))
    for read in (
        lambda: storage.load_state_dict(folder, keys=["w"]),
        lambda: storage.load_into(model, folder, strict=False),
    ):
        size = item.stat().st_size
        _raises(storage.IncompleteCheckpointError, f"item file '{item.name}' has {size}", read)
    assert torch.equal(model.w.detach(), torch.zeros(64, 64))  # left untouched
    report = storage.catalog.verify(folder)
    assert any("it is truncated" in p for p in report.problems), report.problems


def test_dcp_missing_item_file_is_incomplete(tmp_path: pathlib.Path) -> None:
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    folder = _dcp_save({"w": w}, tmp_path / "dcp")
    (item,) = pathlib.Path(folder).glob("*.distcp")
    item.unlink()
    _raises(
        storage.IncompleteCheckpointError,
        f"item file '{item.name}', listed in .metadata, is missing",
        lambda: storage.load_state_dict(folder),
    )


# -- hf ---------------------------------------------------------------------------------------------

SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _hf_sharded(folder: pathlib.Path, weight_map: dict[str, str]) -> str:
    """Two shards written by safetensors (``a`` in the first, ``b`` in the second) and an index
    of ``weight_map``."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / SHARD_1))
    save_file({"b": torch.full((3,), 2.0)}, str(folder / SHARD_2))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(folder)


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        (
            {"a": SHARD_1, "b": SHARD_2, "c": SHARD_2},
            f"puts tensor 'c' in '{SHARD_2}', but no shard it lists holds it",
        ),
        (
            {"a": SHARD_2, "b": SHARD_2, "c": SHARD_1},
            f"puts tensor 'a' in '{SHARD_2}', but it is in '{SHARD_1}'",
        ),
    ],
    ids=["names a tensor no shard holds", "puts a tensor in another shard"],
)
def test_hf_index_disagreeing_with_its_shards_is_corrupt(
    tmp_path: pathlib.Path, weight_map: dict[str, str], message: str
) -> None:
    folder = _hf_sharded(tmp_path / "hf", weight_map)
    for read in (
        lambda: storage.load_state_dict(folder),
        lambda: storage.catalog.verify(folder),
    ):
        _raises(storage.CorruptCheckpointError, message, read)
    code, text = _cli("verify", folder)
    assert code == 2 and message in text, (code, text)


def test_hf_index_naming_a_missing_shard_is_incomplete(tmp_path: pathlib.Path) -> None:
    folder = _hf_sharded(tmp_path / "hf", {"a": SHARD_1, "b": SHARD_2})
    (tmp_path / "hf" / SHARD_2).unlink()
    message = f"lists shard(s) ['{SHARD_2}'], missing from"
    for read in (
        lambda: storage.load_state_dict(folder),
        lambda: storage.catalog.verify(folder),
    ):
        _raises(storage.IncompleteCheckpointError, message, read)


def test_hf_index_agreeing_with_its_shards_loads(tmp_path: pathlib.Path) -> None:
    folder = _hf_sharded(tmp_path / "hf", {"a": SHARD_1, "b": SHARD_2})
    got = storage.load_state_dict(folder)
    assert sorted(got) == ["a", "b"] and torch.equal(got["b"], torch.full((3,), 2.0))
    assert storage.catalog.verify(folder).ok


# -- torch.save -------------------------------------------------------------------------------------


def test_torch_tensors_in_lists_of_dicts_are_loaded(tmp_path: pathlib.Path) -> None:
    """Tensors under a list of dicts (or of lists) are named as DCP and ``storage.save`` flatten
    them (``layers.0.w``); lists holding no tensor stay one value, as before."""
    g = torch.Generator().manual_seed(3)
    tensors = {
        "layers.0.w": torch.randn(4, 3, generator=g),
        "layers.0.b": torch.randn(3, generator=g).bfloat16(),
        "layers.1.w": torch.randn(4, 3, generator=g),
        "nested.0.0": torch.arange(5, dtype=torch.int16),
        "t.0": torch.randn(2, generator=g),
    }
    param_groups = [{"lr": 0.1, "params": [0, 1]}]
    state = {
        "layers": [
            {"w": tensors["layers.0.w"], "b": tensors["layers.0.b"]},
            {"w": tensors["layers.1.w"]},
        ],
        "nested": [[tensors["nested.0.0"]]],
        "t": (tensors["t.0"], 3),
        "param_groups": param_groups,
        "sizes": [1, [2, 3]],
    }
    path = tmp_path / "state.pt"
    torch.save(state, path)
    got = storage.load_state_dict(str(path))
    assert sorted(got) == sorted(tensors)
    for name, t in tensors.items():  # bitwise
        assert got[name].dtype == t.dtype and torch.equal(
            got[name].view(torch.uint8), t.view(torch.uint8)
        ), name
    with storage.LazyStateDict(str(path)) as lazy:
        assert lazy.values == {"t.1": 3, "param_groups": param_groups, "sizes": [1, [2, 3]]}


@pytest.mark.parametrize(
    ("state", "name"),
    [
        ({"a.b": torch.ones(3), "a": {"b": torch.zeros(5)}}, "a.b"),
        ({"x.y": 5, "x": {"y": torch.ones(2)}}, "x.y"),
        ({"l": [torch.ones(1)], "l.0": torch.zeros(1)}, "l.0"),
    ],
    ids=["two tensors", "a value and a tensor", "a list item and a key"],
)
def test_torch_entries_flattening_to_one_name_are_corrupt(
    tmp_path: pathlib.Path, state: dict[str, Any], name: str
) -> None:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    _raises(
        storage.CorruptCheckpointError,
        f"two entries flatten to the same name {name!r}",
        lambda: storage.load_state_dict(str(path)),
    )


@pytest.mark.timeout(60)
def test_torch_container_at_two_places_is_corrupt_and_found_at_once(
    tmp_path: pathlib.Path,
) -> None:
    """``torch.save`` keeps a shared container once, so a file of a few hundred bytes can hold
    a list of itself twice, 60 levels deep: flattened, that is 2**60 names. A container met a
    second time is refused with both of its places, before any name is multiplied."""
    deep: Any = [torch.ones(1)]
    for _ in range(60):
        deep = [deep, deep]
    shared = {"w": torch.ones(2)}
    for state, first, second in (
        # depth first: the innermost pair is met first (the message shortens such long names)
        ({"deep": deep}, "one list is both 'deep.0.0", ".0.0' and 'deep.0.0"),
        ({"model": shared, "ema": shared}, "one dict is both 'model' and 'ema'", "deepcopy"),
    ):
        path = tmp_path / "state.pt"
        torch.save(state, path)
        assert path.stat().st_size < 100_000
        error = _raises(
            storage.CorruptCheckpointError, first, lambda: storage.load_state_dict(str(path))
        )
        assert second in str(error)


def test_torch_conjugate_and_negative_views_load_as_torch_loads_them(
    tmp_path: pathlib.Path,
) -> None:
    """``torch.save`` keeps a conjugate or negative view as its storage plus a bit; the values
    are those ``torch.load`` gives (contiguous or strided), through every reader."""
    g = torch.Generator().manual_seed(5)
    c = torch.randn(3, 4, dtype=torch.complex64, generator=g)
    state = {
        "conj": c.conj(),
        "conj_t": c.conj().t(),  # strided: read through the storage's copy
        "neg": c.clone().conj().imag,  # the imaginary part of a conjugate: a negative view
        "plain": c,
    }
    path = tmp_path / "views.pt"
    torch.save(state, path)
    want = {
        k: v.resolve_conj().resolve_neg() for k, v in torch.load(path, weights_only=True).items()
    }
    assert want["conj"].is_conj() is False and not torch.equal(want["conj"], c)
    for got in (storage.load_state_dict(str(path)), storage.LazyStateDict(str(path))):
        for name, value in want.items():
            assert torch.equal(got[name], value), name
