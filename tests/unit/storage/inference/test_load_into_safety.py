"""``load_into`` is all or nothing, and casts only when told to.

A failed read (a checksum error in a later piece, a truncated file) leaves every tensor of a real
module bitwise as it was, with the default staging and with ``max_staging_bytes`` forcing the
verify-then-copy passes. A cast across kinds (float <-> int, bool <-> number, real <-> complex)
or to a narrower type needs ``dtype=``; widening within a kind is implicit. The same rule holds
for ``load_state_dict`` and ``LazyStateDict``, whose ``dtype`` is always an explicit request.
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from torch import nn

from ftsdp import storage
from ftsdp.storage.conversion._interfaces import Source
from ftsdp.storage.conversion._sources import FtsdpSource, HfSource
from ftsdp.storage.format._layout import step_dir

MiB = 1 << 20
N = 3 * MiB // 4  # elements of one 3 MiB float32 tensor: three of them exceed one 8 MiB chunk


class Three(nn.Module):
    """Three 3 MiB parameters (read in more than one chunk) and an int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(N))
        self.b = nn.Parameter(torch.randn(N))
        self.c = nn.Parameter(torch.randn(N))
        self.register_buffer("steps", torch.arange(4))


def _bits(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of ``module`` as raw bytes (bitwise comparison, NaN-safe)."""
    return {
        k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in module.state_dict().items()
    }


def _unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _bits(module)
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} was overwritten by a failed load"


def _saved(tmp_path: pathlib.Path) -> tuple[str, Three]:
    torch.manual_seed(0)
    ref = Three()
    url = str(tmp_path / "ckpt")
    opts = storage.SaveOptions(checksum_block_bytes=64 << 10, object_bytes=4 * MiB)
    storage.save({"model": ref.state_dict()}, url, step=1, options=opts)
    return url, ref


def _flip_last_piece(url: str) -> None:
    """Flip one byte in the last piece of ``model.c``, the tensor read last."""
    m = storage.catalog.read_manifest(url)
    piece = m.tensors["model.c"].pieces[-1]
    path = pathlib.Path(url) / step_dir(m.step) / piece.object
    data = bytearray(path.read_bytes())
    data[piece.byte_end - 1] ^= 0xFF
    path.write_bytes(bytes(data))


def _bound(max_staging_bytes: int | None) -> dict[str, int]:
    """The default (no argument) or a staging bound."""
    return {} if max_staging_bytes is None else {"max_staging_bytes": max_staging_bytes}


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    seen: list[tuple[str, int, int]] = []
    for cls in Source.__subclasses__():
        real = cls.read_into

        def spy(self: Any, requests: Any, real: Any = real) -> None:
            seen.extend((n, o, t.numel()) for n, o, t in requests)
            real(self, requests)

        monkeypatch.setattr(cls, "read_into", spy)
    return seen


@pytest.mark.parametrize("max_staging_bytes", [None, MiB])
def test_checksum_error_in_a_later_piece_leaves_the_module_untouched(
    tmp_path: pathlib.Path, max_staging_bytes: int | None
) -> None:
    url, _ = _saved(tmp_path)
    _flip_last_piece(url)
    torch.manual_seed(1)
    model = Three()
    before = _bits(model)
    with pytest.raises(
        storage.CorruptCheckpointError, match="checksum mismatch in tensor 'model.c'"
    ):
        storage.load_into(model, url, prefix="model.", **_bound(max_staging_bytes))
    _unchanged(model, before)


def test_hf_file_cut_while_read_leaves_the_module_untouched(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = _saved(tmp_path)
    hf = tmp_path / "hf"
    storage.conversion.convert(url, str(hf), to="hf")
    (file,) = hf.glob("*.safetensors")
    data = file.read_bytes()
    real = HfSource.read_into

    def cut(self: HfSource, requests: Any) -> None:  # truncated after the header was read
        if any(name == "model.c" for name, _, _ in requests):
            file.write_bytes(data[:-1000])
        real(self, requests)

    monkeypatch.setattr(HfSource, "read_into", cut)
    for max_staging_bytes in (None, MiB):
        file.write_bytes(data)
        torch.manual_seed(1)
        model = Three()
        before = _bits(model)
        # the file held open since its header was read: the cut is named as a change
        with pytest.raises(storage.CorruptCheckpointError, match="changed since it was opened"):
            storage.load_into(model, str(hf), prefix="model.", **_bound(max_staging_bytes))
        _unchanged(model, before)
    # Truncated at rest: the header's offsets are checked when the file is opened.
    with pytest.raises(storage.CorruptCheckpointError, match="outside the"):
        storage.load_into(model, str(hf), prefix="model.")
    _unchanged(model, before)


def test_staging_once_or_two_verified_passes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ref = _saved(tmp_path)
    model = Three()
    kept = model.a
    result = storage.load_into(model, url, prefix="model.")
    assert model.a is kept and torch.equal(model.c, ref.c)
    assert result.staged_bytes == 3 * N * 4 + 4 * 8  # the loaded tensors' bytes, once
    reads = _count_reads(monkeypatch)
    model = Three()
    result = storage.load_into(model, url, prefix="model.", max_staging_bytes=MiB)
    assert result.staged_bytes == 0
    assert sum(n for name, _, n in reads if name == "model.c") == 2 * N  # verified, then copied
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    with torch.device("meta"):
        meta = Three()
    assert storage.load_into(meta, url, prefix="model.").staged_bytes == 0  # new tensors only
    assert torch.equal(meta.b, ref.b)


class Buf(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("x", torch.zeros(3, dtype=dtype))


def _save_x(tmp_path: pathlib.Path, x: torch.Tensor) -> str:
    url = str(tmp_path / f"x{len(list(tmp_path.iterdir()))}")
    storage.save({"x": x}, url, step=1)
    return url


def test_float_into_int_needs_dtype(tmp_path: pathlib.Path) -> None:
    url = _save_x(tmp_path, torch.tensor([1.5, 2.5, -1.5]))
    model = Buf(torch.int32)
    model.x.fill_(7)
    with pytest.raises(
        storage.StateMismatchError, match=r"'x'.*saved torch.float32.*torch.int32.*dtype="
    ):
        storage.load_into(model, url)
    assert model.x.tolist() == [7, 7, 7]  # refused before anything was read
    storage.load_into(model, url, dtype=torch.int32)
    assert model.x.dtype == torch.int32 and model.x.tolist() == [1, 2, -1]


def test_large_int_into_half_needs_dtype(tmp_path: pathlib.Path) -> None:
    url = _save_x(tmp_path, torch.full((3,), 2**40, dtype=torch.int64))
    model = Buf(torch.float16)
    with pytest.raises(storage.StateMismatchError, match=r"int64.*float16"):
        storage.load_into(model, url)
    assert model.x.tolist() == [0.0, 0.0, 0.0]
    storage.load_into(model, url, dtype=torch.float16)  # asked for: inf, as torch casts
    assert torch.isinf(model.x).all()


def test_widening_within_a_kind_is_implicit(tmp_path: pathlib.Path) -> None:
    saved = torch.tensor([1.0, 2.0**-10, 3.0e38]).to(torch.bfloat16)
    model = Buf(torch.float32)
    storage.load_into(model, _save_x(tmp_path, saved))
    assert model.x.dtype == torch.float32 and torch.equal(model.x, saved.float())
    model = Buf(torch.int64)
    storage.load_into(model, _save_x(tmp_path, torch.tensor([-(2**31), 5, 2**31 - 1])))
    assert model.x.tolist() == [-(2**31), 5, 2**31 - 1]
    model = Buf(torch.bool)
    storage.load_into(model, _save_x(tmp_path, torch.tensor([True, False, True])))
    assert model.x.tolist() == [True, False, True]


def test_narrowing_float_needs_dtype_also_on_meta(tmp_path: pathlib.Path) -> None:
    url = _save_x(tmp_path, torch.tensor([1.0, 1.0 + 2.0**-20, 3.0]))
    with torch.device("meta"):
        model = Buf(torch.bfloat16)
    with pytest.raises(
        storage.StateMismatchError, match=r"float32.*bfloat16.*dtype=torch.bfloat16"
    ):
        storage.load_into(model, url)
    assert model.x.is_meta
    storage.load_into(model, url, dtype=torch.bfloat16)
    assert model.x.dtype == torch.bfloat16 and model.x.tolist() == [1.0, 1.0, 3.0]
    for bad in (torch.int32, torch.bool):  # int64 -> int32 narrows; int -> bool changes kind
        with pytest.raises(storage.StateMismatchError):
            storage.load_into(Buf(bad), _save_x(tmp_path, torch.tensor([1, 2, 3])))


def test_load_state_dict_and_lazy_follow_the_rule(tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "mixed")
    storage.save(
        {"f": torch.tensor([1.5, -2.5]), "i": torch.tensor([2**40, 3]), "b": torch.tensor([True])},
        url,
        step=1,
    )
    sd = storage.load_state_dict(url)  # saved dtypes
    assert (sd["f"].dtype, sd["i"].dtype, sd["b"].dtype) == (torch.float32, torch.int64, torch.bool)
    sd = storage.load_state_dict(url, dtype=torch.float16)  # applies to floating tensors only
    assert (sd["f"].dtype, sd["i"].dtype, sd["b"].dtype) == (torch.float16, torch.int64, torch.bool)
    assert sd["i"].tolist() == [2**40, 3]  # never silently cast to the float dtype
    with storage.LazyStateDict(url, dtype=torch.int32) as lazy:  # applies to integer tensors only
        assert lazy["i"].dtype == torch.int32 and lazy["f"].dtype == torch.float32


def test_checkpoint_changed_between_the_two_passes_is_named(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = _saved(tmp_path)
    real = FtsdpSource.read_into
    seen = []

    def change(self: FtsdpSource, requests: Any) -> None:
        if any(name == "model.c" for name, _, _ in requests):
            seen.append(1)
            if len(seen) == 2:  # the copy pass: the verify pass has read model.c
                _flip_last_piece(url)
        real(self, requests)

    monkeypatch.setattr(FtsdpSource, "read_into", change)
    with pytest.raises(storage.CorruptCheckpointError) as err:
        storage.load_into(Three(), url, prefix="model.", max_staging_bytes=MiB)
    assert "the module is partly overwritten" in "".join(err.value.__notes__)
