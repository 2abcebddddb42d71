"""A sharded Hugging Face folder written by transformers itself (``save_pretrained`` with a small
``max_shard_size``: several ``model-0000k-of-0000n.safetensors`` and the index) is read by every
reader: ``load_state_dict``, ``load_into``, ``LazyStateDict``, ``convert`` and ``ftsdp-ckpt
inspect / verify``. The reference is the model's own ``state_dict()``; everything else the tests
check against (the index's ``weight_map`` and ``total_size``) is what transformers wrote.

GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``: transformers saves the tied weight
once, under the embedding's name, so the folder holds every key of ``state_dict()`` but that one.
"""

from __future__ import annotations

import io
import json
import pathlib
from typing import Any

import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main

transformers = pytest.importorskip("transformers")

TIED = "lm_head.weight"  # saved once, as transformer.wte.weight


def _config() -> Any:
    return transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict]:
    """The folder and ``model.state_dict()`` (cloned) of a tiny GPT-2 saved in 20 kB shards."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    path = tmp_path_factory.mktemp("hf-sharded")
    model.save_pretrained(str(path), max_shard_size="20KB")
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _saved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k != TIED}


def _same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_folder_is_sharded_as_transformers_writes_it(folder) -> None:
    path, state = folder
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all(s.startswith("model-0000") for s in shards), shards
    assert sorted(p.name for p in path.glob("*.safetensors")) == shards
    assert sorted(index["weight_map"]) == sorted(_saved(state))
    assert storage.conversion.detect_format(str(path)) == "hf"


def test_load_state_dict_reads_every_shard(folder) -> None:
    path, state = folder
    _same(storage.load_state_dict(str(path)), _saved(state))
    some = ["transformer.h.1.attn.c_attn.weight", "transformer.wpe.weight"]
    _same(storage.load_state_dict(str(path), keys=some), {k: state[k] for k in some})


def test_load_into_a_fresh_model_gives_the_same_weights_and_logits(folder) -> None:
    path, state = folder
    for device in ("meta", "cpu"):
        with torch.device(device):
            torch.manual_seed(1)  # other weights than the saved ones, on cpu
            model = transformers.GPT2LMHeadModel(_config())
        if device == "cpu":
            assert not torch.equal(model.transformer.wpe.weight, state["transformer.wpe.weight"])
        res = storage.load_into(model, str(path))
        assert (res.missing, res.unexpected, res.still_meta) == ([], [], []), res
        _same(model.state_dict(), state)
        assert model.lm_head.weight is model.transformer.wte.weight  # the tie is kept
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(_config())
    tokens = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, original.eval()(tokens).logits)


def test_lazy_state_dict_reads_names_shapes_and_ranges(folder) -> None:
    path, state = folder
    saved = _saved(state)
    with storage.LazyStateDict(str(path)) as lazy:
        assert lazy.format == "hf" and sorted(lazy) == sorted(saved) and len(lazy) == len(saved)
        for name, t in saved.items():
            info = lazy.info(name)
            assert (tuple(info.shape), info.dtype) == (tuple(t.shape), t.dtype), name
        name = "transformer.h.0.mlp.c_fc.weight"  # a flat range inside one tensor of a shard
        assert torch.equal(lazy.read(name, 100, 333), saved[name].reshape(-1)[100:433])
        _same(dict(lazy.items()), saved)
        assert TIED not in lazy


@pytest.mark.parametrize("to", ["ftsdp", "torch", "hf"])
def test_convert_reads_every_shard(folder, tmp_path: pathlib.Path, to: str) -> None:
    path, state = folder
    dst = str(tmp_path / ("out.pt" if to == "torch" else "out"))
    result = storage.conversion.convert(
        str(path), dst, to=to, world_size=2 if to == "ftsdp" else None
    )
    assert result.source_format == "hf" and result.tensors == len(_saved(state))
    if to == "torch":  # a plain torch.save file of the flat state dict
        _same(torch.load(dst, weights_only=True), _saved(state))
    else:
        _same(storage.load_state_dict(dst), _saved(state))


def test_ckpt_inspect_and_verify(folder) -> None:
    path, state = folder
    saved = _saved(state)
    code, out, _ = _cli("inspect", str(path), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["format"] == "hf"
    listed = {t["name"]: t for t in info["tensors"]}
    assert sorted(listed) == sorted(saved)
    for name, t in saved.items():
        assert listed[name]["shape"] == list(t.shape), name
        assert listed[name]["dtype"] == str(t.dtype).removeprefix("torch."), name
        assert listed[name]["bytes"] == t.numel() * t.element_size(), name
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert info["total_bytes"] == index["metadata"]["total_size"]  # transformers' own count
    assert info["total_tensors"] == len(saved)
    code, out, _ = _cli("verify", str(path))
    assert code == 0 and out.startswith("OK: hf"), out
