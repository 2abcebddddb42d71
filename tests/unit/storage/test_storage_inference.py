"""Loading for inference in one process: ``load_state_dict`` (only the requested tensors, from any
world size), ``load_into`` (meta-device modules, tied weights, missing / unexpected keys) and the
lazy ``LazyStateDict``."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.storage.conversion._interfaces import Source

SMALL = storage.SaveOptions(checksum_block_bytes=64, object_bytes=5000)


class TinyLM(nn.Module):
    """Embedding tied to the output head, a buffer, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0))
        self.proj.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.emb(x)) * self.scale)


def _saved(tmp_path: pathlib.Path, world_size: int = 3) -> tuple[str, TinyLM]:
    """TinyLM + fake optimizer state, saved once and resharded to ``world_size`` ranks."""
    torch.manual_seed(0)
    model = TinyLM()
    sd = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied: saved once
    optim = {k: torch.randn_like(v) for k, v in sd.items() if v.is_floating_point()}
    storage.save(
        {"model": sd, "optim": optim, "trainer": {"step": 5}},
        str(tmp_path / "w1"),
        step=5,
        options=SMALL,
    )
    url = str(tmp_path / f"w{world_size}")
    storage.conversion.reshard(str(tmp_path / "w1"), url, world_size)
    return url, model


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    seen: list[tuple[str, int, int]] = []
    for cls in Source.__subclasses__():
        real = cls.read_into

        def spy(self: Any, requests: Any, real: Any = real) -> None:
            seen.extend((n, o, t.numel()) for n, o, t in requests)
            real(self, requests)

        monkeypatch.setattr(cls, "read_into", spy)
    return seen


def test_load_state_dict_reads_only_requested(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, model = _saved(tmp_path)
    assert storage.catalog.read_manifest(url).world_size == 3
    reads = _count_reads(monkeypatch)
    got = storage.load_state_dict(url, keys=["model.proj.weight", "model.scale"])
    assert sorted(got) == ["model.proj.weight", "model.scale"]
    assert torch.equal(got["model.proj.weight"], model.proj.weight.detach())
    assert {n for n, _, _ in reads} == {"model.proj.weight", "model.scale"}
    assert sum(n for _, _, n in reads) == 64 + 1
    half = storage.load_state_dict(url, keys=["model.emb.weight"], dtype=torch.bfloat16)
    assert half["model.emb.weight"].dtype == torch.bfloat16
    with pytest.raises(KeyError, match=r"no tensor\(s\) \['model.nope'\]"):
        storage.load_state_dict(url, keys=["model.nope"])


def test_load_into_meta_module_keeps_ties_and_flags(tmp_path: pathlib.Path) -> None:
    url, ref = _saved(tmp_path)
    with torch.device("meta"):
        model = TinyLM()
    result = storage.load_into(model, url, prefix="model.")
    assert (
        result.step == 5
        and result.missing == []
        and result.unexpected == []
        and result.still_meta == []
    )
    assert model.head.weight is model.emb.weight  # still tied
    assert not model.proj.bias.requires_grad and model.proj.weight.requires_grad
    assert model.emb.weight.device.type == "cpu"
    x = torch.randint(0, 16, (3, 5))
    assert torch.equal(model(x), ref(x))


def test_load_into_real_module_in_place(tmp_path: pathlib.Path) -> None:
    url, ref = _saved(tmp_path)
    model = TinyLM()
    before = model.proj.weight
    storage.load_into(model, url, prefix="model.")
    assert model.proj.weight is before  # filled in place, no second copy
    assert torch.equal(model.proj.weight, ref.proj.weight)
    storage.load_into(model, url, prefix="model.", dtype=torch.float16)
    assert model.proj.weight.dtype == torch.float16 and model.head.weight is model.emb.weight


def test_load_into_missing_and_unexpected(tmp_path: pathlib.Path) -> None:
    url, _ = _saved(tmp_path)

    class Other(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.extra = nn.Linear(2, 2)

    model = Other()
    before = model.proj.weight.detach().clone()
    with pytest.raises(
        storage.StateMismatchError, match=r"missing=\['extra.bias', 'extra.weight'\]"
    ):
        storage.load_into(model, url, prefix="model.")
    assert torch.equal(model.proj.weight, before)  # strict: nothing loaded
    result = storage.load_into(model, url, prefix="model.", strict=False)
    assert result.missing == ["extra.bias", "extra.weight"] and result.unexpected == []
    assert not torch.equal(model.proj.weight, before)
    with torch.device("meta"):
        small = nn.Linear(8, 4)
    with pytest.raises(
        storage.StateMismatchError,
        match=r"shape mismatches=\['weight \(saved \[8, 8\], module \[4, 8\]\)'",
    ):
        storage.load_into(small, url, prefix="model.proj.")


def test_lazy_mapping_reads_on_first_access(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ref = _saved(tmp_path)
    reads = _count_reads(monkeypatch)
    with storage.LazyStateDict(url) as ckpt:
        assert ckpt.step == 5 and ckpt.format == "ftsdp" and ckpt.values == {"trainer.step": 5}
        assert "model.proj.weight" in ckpt and len(ckpt) == 8
        assert ckpt.info("optim.emb.weight").shape == (16, 8)
        assert reads == []  # metadata only so far
        w = ckpt["model.proj.weight"]
        assert torch.equal(w, ref.proj.weight) and {n for n, _, _ in reads} == {"model.proj.weight"}
        n = len(reads)
        assert ckpt["model.proj.weight"] is w and len(reads) == n  # cached
        part = ckpt.read("model.emb.weight", 10, 20)
        assert torch.equal(part, ref.emb.weight.detach().reshape(-1)[10:30])
        with pytest.raises(KeyError):
            ckpt["nope"]
    hf = str(tmp_path / "hf")
    storage.conversion.convert(url, hf, to="hf", model_only=True)
    lazy = storage.LazyStateDict(hf, dtype=torch.float16)
    assert lazy.format == "hf" and lazy["model.emb.weight"].dtype == torch.float16
