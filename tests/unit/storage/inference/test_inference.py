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
    one = storage.load_state_dict(url, keys="model.scale")  # one name, not its characters
    assert list(one) == ["model.scale"] and torch.equal(one["model.scale"], got["model.scale"])
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        storage.load_state_dict(url, dtype="bfloat16")  # type: ignore[arg-type]


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


@pytest.mark.parametrize("meta", [False, True])
def test_a_tied_weight_saved_twice_with_other_bytes_loads_as_torch_loads_it(
    tmp_path: pathlib.Path, meta: bool
) -> None:
    """Copies of one tied weight that differ in the checkpoint: the last name's, as torch's
    ``load_state_dict`` gives (it copies each name in turn)."""
    sd = {k: torch.randn_like(v) for k, v in TinyLM().state_dict().items()}  # head != emb
    torch.save(sd, tmp_path / "c.pt")
    want = TinyLM()
    want.load_state_dict(sd)
    with torch.device("meta" if meta else "cpu"):
        model = TinyLM()
    storage.load_into(model, str(tmp_path / "c.pt"))
    assert model.head.weight is model.emb.weight  # still tied
    assert torch.equal(model.emb.weight, want.emb.weight)
    assert torch.equal(model.emb.weight, sd["head.weight"])


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


def test_a_closed_lazy_mapping_refuses_to_read_as_a_closed_file_does(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ref = _saved(tmp_path)
    reads = _count_reads(monkeypatch)
    ckpt = storage.LazyStateDict(url)
    assert torch.equal(ckpt["model.proj.weight"], ref.proj.weight)
    ckpt.close()
    n = len(reads)
    out = torch.zeros(4)
    for read in (
        lambda: ckpt["model.proj.weight"],  # cached before the close: dropped with the reader
        lambda: ckpt["model.emb.weight"],
        lambda: ckpt.read("model.emb.weight", 0, 4),
        lambda: ckpt.fill_ranges([("model.emb.weight", 0, out)]),
    ):
        with pytest.raises(ValueError, match="is closed"):
            read()
    assert len(reads) == n and not out.any()  # nothing was read again
    # what needs no tensor still answers, and a second close is fine
    assert "model.emb.weight" in ckpt and ckpt.info("model.emb.weight").shape == (16, 8)
    assert ckpt.values == {"trainer.step": 5}
    ckpt.close()
    with storage.LazyStateDict(url) as again:  # a new one reads
        assert torch.equal(again["model.proj.weight"], ref.proj.weight)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_fill_ranges_reads_only_its_ranges_all_or_nothing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ref = _saved(tmp_path)
    emb, proj = ref.emb.weight.detach().reshape(-1), ref.proj.weight.detach().reshape(-1)
    reads = _count_reads(monkeypatch)
    with storage.LazyStateDict(url) as ckpt:
        a, b = torch.full((30,), -1.0), torch.full((7,), -1.0, dtype=torch.float64)  # a widening
        assert ckpt.fill_ranges([("model.emb.weight", 10, a), ("model.proj.weight", 5, b)]) == 37
        assert torch.equal(a, emb[10:40]) and torch.equal(b, proj[5:12].double())
        assert sorted(reads) == [("model.emb.weight", 10, 30), ("model.proj.weight", 5, 7)]
        reads.clear()
        # refused before anything is read
        with pytest.raises(storage.StateMismatchError, match="refusing to cast"):
            ckpt.fill_ranges([("model.emb.weight", 0, torch.empty(4, dtype=torch.bfloat16))])
        with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
            ckpt.fill_ranges([("model.emb.weight", 100, torch.empty(29))])
        with pytest.raises(KeyError, match="nope"):
            ckpt.fill_ranges([("nope", 0, torch.empty(1))])
        assert reads == []
        # a read that fails half-way writes nothing: every target keeps its values
        real = type(ckpt._source).read_into
        calls = []

        def fail_second(self: Any, requests: Any) -> None:
            calls.append(len(requests))
            if len(calls) == 2:
                raise OSError("injected")
            real(self, requests)

        monkeypatch.setattr(type(ckpt._source), "read_into", fail_second)
        c, d = torch.full((16,), 7.0), torch.full((16,), 7.0)
        with pytest.raises(OSError, match="injected"):
            ckpt.fill_ranges([("model.emb.weight", 0, c), ("model.emb.weight", 16, d)], chunk=64)
        assert len(calls) == 2 and bool((c == 7).all()) and bool((d == 7).all())
    # bf16 saved, fp32 targets (pretrained weights into fp32 master weights): a widening
    from safetensors.torch import save_file

    half = torch.randn(6, 5).to(torch.bfloat16)
    save_file({"w": half}, str(tmp_path / "half.safetensors"))
    with storage.LazyStateDict(str(tmp_path / "half.safetensors")) as ckpt:
        e = torch.empty(11)
        ckpt.fill_ranges([("w", 13, e)])
    assert torch.equal(e, half.reshape(-1)[13:24].float())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
@pytest.mark.parametrize("fmt", ["hf", "torch", "dcp"])
def test_fill_ranges_reads_only_the_bytes_asked_for(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    # The formats with no checksum blocks: the bytes read are exactly the ranges' (an ftsdp
    # step reads whole checksum blocks around them: test_load_state_dict_reads_only_requested).
    url, ref = _saved(tmp_path)
    dst = str(tmp_path / ("out.pt" if fmt == "torch" else "out"))
    storage.conversion.convert(url, dst, to=fmt, model_only=True)
    from ftsdp.storage.io._fs import Store

    seen: list[int] = []
    real = Store._read_into_once

    def spy(self: Any, rel: str, start: int, view: Any) -> None:
        seen.append(len(view))
        real(self, rel, start, view)

    with storage.LazyStateDict(dst) as ckpt:
        ckpt.fill_ranges([("model.emb.weight", 0, torch.empty(1))])  # a layout's first read
        monkeypatch.setattr(Store, "_read_into_once", spy)
        a, b = torch.empty(30), torch.empty(7)
        ckpt.fill_ranges([("model.emb.weight", 10, a), ("model.proj.weight", 5, b)])
    assert torch.equal(a, ref.emb.weight.detach().reshape(-1)[10:40])
    assert torch.equal(b, ref.proj.weight.detach().reshape(-1)[5:12])
    assert sum(seen) == 37 * 4, seen


class _Scaled(nn.Linear):
    """A module with extra state (fp8 modules keep their scales so): a tensor or a value."""

    def __init__(self, extra: Any) -> None:
        super().__init__(4, 3)
        self.extra = extra

    def get_extra_state(self) -> Any:  # made anew at each call, as fp8 modules serialize
        return self.extra.clone() if isinstance(self.extra, torch.Tensor) else list(self.extra)

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


@pytest.mark.parametrize("kind", ["tensor", "value"])
def test_load_into_hands_extra_state_to_set_extra_state(tmp_path: pathlib.Path, kind: str) -> None:
    """As ``Module.load_state_dict`` does: the saved extra state reaches ``set_extra_state``
    (it was copied into the throwaway tensor ``state_dict()`` returned, and reported loaded)."""
    torch.manual_seed(0)
    saved_extra = torch.tensor([7.0, 8.0]) if kind == "tensor" else [2.5, "e4m3"]
    src = nn.Sequential(_Scaled(saved_extra), nn.ReLU())
    url = str(tmp_path / "ck")
    state = src.state_dict()
    if kind == "value":  # a non-tensor is a JSON value of an ftsdp checkpoint
        state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        state["0._extra_state"] = [2.5, "e4m3"]
    storage.save(state, url, 1)
    dst = nn.Sequential(_Scaled(torch.zeros(2) if kind == "tensor" else [0.0, ""]), nn.ReLU())
    result = storage.load_into(dst, url)
    assert result.missing == [] and result.unexpected == []
    assert torch.equal(dst[0].weight, src[0].weight)
    if kind == "tensor":
        assert torch.equal(dst[0].extra, saved_extra)
    else:
        assert dst[0].extra == [2.5, "e4m3"]
    bare = nn.Sequential(_Scaled([]), nn.ReLU())
    storage.save({k: v for k, v in src.state_dict().items() if "extra" not in k}, url, 2)
    with pytest.raises(storage.StateMismatchError, match=r"missing=\['0._extra_state'\]"):
        storage.load_into(bare, url)  # strict: an extra state the checkpoint lacks is missing


def test_a_tensor_no_loader_can_represent_is_named_not_dropped_unsaid(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A uint16 tensor in a safetensors file (a dtype the format has no code for): every loader
    says so. The others load; the warning names it; asking for it by name says the file holds
    it and why it cannot be loaded (not that it is absent); a strict ``load_into`` says why it
    is missing."""
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_file({"ids": torch.tensor([1, 65535], dtype=torch.uint16), "w": w}, str(path))
    why = "ids (safetensors dtype U16 unsupported)"
    with caplog.at_level("WARNING", logger="ftsdp.storage"):
        got = storage.load_state_dict(str(path))
    assert sorted(got) == ["w"] and torch.equal(got["w"], w)
    assert any(why in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(KeyError, match=r"holds, but cannot load: ids \(safetensors dtype U16"):
        storage.load_state_dict(str(path), keys=["ids"])
    with pytest.raises(KeyError, match=r"has no tensor\(s\) \['nope'\] and holds, but cannot"):
        storage.load_state_dict(str(path), keys=["nope", "ids"])
    with storage.LazyStateDict(str(path)) as lazy, pytest.raises(KeyError, match="cannot load"):
        lazy["ids"]

    class WithIds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3))
            self.register_buffer("ids", torch.zeros(2, dtype=torch.int32))

    module = WithIds()
    with pytest.raises(storage.StateMismatchError, match="ids is in it but cannot be loaded"):
        storage.load_into(module, str(path))
    assert not module.w.any()  # nothing written


@pytest.mark.parametrize("max_staging_bytes", [None, 64], ids=["staged", "bounded"])
def test_load_into_fills_a_strided_parameter_in_place(tmp_path, max_staging_bytes) -> None:
    """A channels_last convolution's weight (not contiguous) is filled in place, as torch's
    ``load_state_dict`` does: the same Parameter (an optimizer built before still holds it),
    the same memory format, the saved values."""
    torch.manual_seed(0)
    saved = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    url = str(tmp_path / "ckpt")
    storage.save({k: v.detach() for k, v in saved.state_dict().items()}, url, 1)
    model = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    weight = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not weight.is_contiguous()
    storage.load_into(model, url, max_staging_bytes=max_staging_bytes)
    assert model.weight is weight and opt.param_groups[0]["params"][0] is weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)


def test_close_stops_a_read_in_flight(tmp_path: pathlib.Path) -> None:
    """A read that close() overtakes raises and keeps nothing; every read after close() raises."""
    import threading

    url = str(tmp_path / "root")
    ref = {"a": torch.randn(64, 8), "b": torch.randn(64, 8)}
    storage.save(ref, url, step=1)
    for what in ("getitem", "fill_ranges"):
        lz = storage.LazyStateDict(url)
        real, started, go = lz._source.read_into, threading.Event(), threading.Event()

        def blocked(requests: Any, real: Any = real, started: Any = started, go: Any = go) -> None:
            started.set()
            assert go.wait(10)
            real(requests)

        lz._source.read_into = blocked  # type: ignore[method-assign]
        out, target = [], torch.zeros(8)

        def reader(lz: Any = lz, what: str = what, out: list = out, target: Any = target) -> None:
            try:
                if what == "getitem":
                    out.append(lz["a"])
                else:
                    lz.fill_ranges([("a", 0, target)])
                    out.append(target)
            except ValueError as e:
                out.append(e)

        t = threading.Thread(target=reader)
        t.start()
        assert started.wait(10)
        lz.close()
        go.set()
        t.join(10)
        assert isinstance(out[0], ValueError) and "closed" in str(out[0]), out
        assert not lz._cache  # before: the tensor read in flight was cached after close()
        assert torch.equal(target, torch.zeros(8))  # all or nothing: not written
        for name in ("a", "b"):
            with pytest.raises(ValueError, match="closed"):
                lz[name]
