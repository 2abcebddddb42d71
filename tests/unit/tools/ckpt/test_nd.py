"""``ftsdp-ckpt`` and the loaders on N-D checkpoints (storage format version 5: DTensor boxes
saved in a grid order), on a copy of the golden checkpoint tests/golden/storage_v5 (4 ranks on a
2 x 2 mesh): convert through every format and back, reshard, diff, verify, ``load_state_dict``,
``LazyStateDict`` and ``load_into``, each bitwise against ``make_storage_golden_v5.reference()``."""

from __future__ import annotations

import io
import json
import math
import pathlib
import shutil
import warnings

import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main
from tests.make_storage_golden_v5 import GOLDEN_V5, STEP, reference

REF = {f"model.{k}": v for k, v in reference().items()}


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor] = REF) -> None:
    assert sorted(got) == sorted(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


@pytest.fixture
def golden(tmp_path: pathlib.Path) -> str:
    """A copy of the golden checkpoint (the checked-in one is never written)."""
    shutil.copytree(GOLDEN_V5, tmp_path / "golden")
    return str(tmp_path / "golden")


def test_loaders_read_the_golden_bitwise(golden: str) -> None:
    """``load_state_dict`` (all, some keys), ``LazyStateDict`` (whole tensors and flat ranges
    that cross the grid's cells) give the reference's elements."""
    _same(storage.load_state_dict(golden))
    some = storage.load_state_dict(golden, keys=["model.cube", "model.even"])
    _same(some, {k: REF[k] for k in ("model.cube", "model.even")})
    lazy = storage.LazyStateDict(golden)
    _same(dict(lazy.items()))
    for name, t in REF.items():
        flat = t.flatten()
        for offset, length in ((0, flat.numel()), (1, flat.numel() - 2), (flat.numel() // 3, 4)):
            got = lazy.read(name, offset, length)
            assert torch.equal(got, flat[offset : offset + length]), (name, offset, length)


class _Model(torch.nn.Module):
    """Parameters (and an int buffer) with the golden's shapes and names (under ``model.``)."""

    def __init__(self) -> None:
        super().__init__()
        for name, t in REF.items():
            key = name.removeprefix("model.")
            if t.is_floating_point():
                setattr(self, key, torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype)))
            else:
                self.register_buffer(key, torch.zeros(t.shape, dtype=t.dtype))


@pytest.mark.parametrize("meta", [False, True])
def test_load_into_a_module(golden: str, meta: bool) -> None:
    with torch.device("meta" if meta else "cpu"):
        model = _Model()
    result = storage.load_into(model, golden, prefix="model.")
    assert result.step == STEP and not result.missing and not result.unexpected
    assert not result.still_meta
    _same({f"model.{k}": v.detach() for k, v in model.state_dict().items()})


_AS_SAVED = {"hf": ["--include-optimizer", "--keep-names"]}  # every name, as saved


def _dcp_read(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a DCP checkpoint as torch's own ``dcp.load`` reads them (one process)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert sorted(n for n in metadata if n.startswith("model.")) == sorted(REF)
    target = {n: torch.full_like(t, 7) for n, t in REF.items()}  # none of them is all 7s
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


@pytest.mark.parametrize("fmt", ["hf", "torch", "dcp"])
def test_convert_and_back(golden: str, tmp_path: pathlib.Path, fmt: str) -> None:
    """golden -> FORMAT (read by that format's own reader) -> ftsdp: bitwise each time."""
    mid = str(tmp_path / ("mid.pt" if fmt == "torch" else "mid"))
    code, _, err = _cli("convert", golden, mid, "--to", fmt, *_AS_SAVED.get(fmt, []), "-q")
    assert code == 0, err
    if fmt == "hf":
        from safetensors.torch import load_file

        _same(load_file(f"{mid}/model.safetensors"))
    elif fmt == "torch":
        saved = torch.load(mid, weights_only=True)
        _same({k: v for k, v in saved.items() if isinstance(v, torch.Tensor)})
    else:
        _same(_dcp_read(mid))
    back = str(tmp_path / "back")
    code, _, err = _cli("convert", mid, back, "--to", "ftsdp", "--world-size", "3", "-q")
    assert code == 0, err
    _same(storage.load_state_dict(back))


def test_reshard_diff_and_verify(golden: str, tmp_path: pathlib.Path) -> None:
    """Resharded to 3 ranks: loads bitwise; diff against the golden finds no difference (across
    roots, and as two steps of one root), then names the one tensor changed; verify passes, then
    finds a flipped byte."""
    out = str(tmp_path / "resharded")
    code, text, err = _cli("reshard", golden, out, "--world-size", "3", "--dst-step", "14", "-q")
    assert code == 0 and "step 14 for world size 3" in text, err
    _same(storage.load_state_dict(out))
    assert storage.catalog.inspect_checkpoint(out)["world_size"] == 3
    result = storage.catalog.diff(golden, STEP, out, 14)
    assert {r["status"] for r in result["tensors"]} == {"same"} and len(result["tensors"]) == 6
    shutil.copytree(f"{out}/step-14", f"{golden}/step-14")  # both steps in one root
    changed = {k.removeprefix("model."): v.clone() for k, v in REF.items()}
    changed["down"][4, 6] += 1  # in the last cell of the 2 x 2 grid
    storage.save({"model": changed, "trainer": {"step": STEP, "rank": 0}}, golden, step=15)
    code, text, err = _cli("diff", golden, "13", "14", "-q")
    assert code == 0 and "6 same" in text and "changed" not in text, err
    code, text, err = _cli("diff", golden, "13", "15", "--json", "-q")
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(text)["tensors"]}
    assert rows["model.down"]["status"] == "changed" and rows["model.down"]["changed"] == 1
    assert rows["model.down"]["max_abs_diff"] == 1.0
    assert {r["status"] for n, r in rows.items() if n != "model.down"} == {"same"}

    code, text, err = _cli("verify", golden, "-q")
    assert code == 0 and text.startswith("OK"), (text, err)
    obj = sorted(pathlib.Path(golden, "step-13").glob("rank00001-002-*.safetensors"))[0]
    data = bytearray(obj.read_bytes())
    data[-3] ^= 0x10  # in the data, not the header
    obj.write_bytes(bytes(data))
    code, text, err = _cli("verify", golden, "--step", "13", "-q")
    assert code == 1 and "FAILED" in text and obj.name in text, (text, err)


def _grids(root: str, step: int = STEP) -> tuple[dict, int, int]:
    """Each tensor's grid (None: row-major), the version and world size of a step's manifest."""
    doc = json.loads(pathlib.Path(root, f"step-{step}", "manifest.json").read_text())
    return {n: t.get("grid") for n, t in doc["tensors"].items()}, doc["version"], doc["world_size"]


_MESHES = {
    "2x2": (
        [],
        {
            "model.bias": None,  # (S0, R): halves of the rows, plain row-major
            "model.cols": [[0, 2, 4], [0, 3, 6]],
            "model.cube": [[0, 1, 2], [0, 2, 4], [0, 6]],
            "model.down": [[0, 3, 5], [0, 4, 7]],  # torch's chunking: 3 + 2 rows, 4 + 3 cols
            "model.even": [[0, 2, 4], [0, 3, 6]],
            "model.up": [[0, 4, 8], [0, 2, 3]],
        },
    ),
    "3x1": ([], dict.fromkeys(REF)),  # rows cut in 3 (2 + 2 + 1; cube: 1 + 1 + none): row-major
    "3x1 placed": (
        ["--placement", "model.cube=S2,S1", "--placement", "model.u*=S1,R"],
        {
            **dict.fromkeys(REF),
            "model.cube": [[0, 2], [0, 4], [0, 2, 4, 6]],
            "model.up": [[0, 8], [0, 1, 2, 3]],
        },
    ),
}


@pytest.mark.parametrize("case", sorted(_MESHES))
def test_reshard_to_a_mesh(golden: str, tmp_path: pathlib.Path, case: str) -> None:
    """``reshard --mesh``: a version 5 step whose grids are the cuts of the placements asked for,
    which loads bitwise and verifies."""
    mesh = case.split()[0]
    flags, want = _MESHES[case]
    out = str(tmp_path / "mesh")
    code, text, err = _cli("reshard", golden, out, "--mesh", mesh, *flags, "-q")
    size = math.prod(int(n) for n in mesh.split("x"))
    assert code == 0 and f"for world size {size} (a {mesh} mesh)" in text, err
    grids, version, world = _grids(out)
    assert grids == want and world == size
    assert version == (5 if any(want.values()) else 3)
    _same(storage.load_state_dict(out))
    assert _cli("verify", out, "-q")[0] == 0


def test_reshard_to_a_mesh_as_dtensors_save(golden: str, tmp_path: pathlib.Path) -> None:
    """With the golden's own placements (those without a strided shard), the grids are the ones
    the 4 ranks' DTensor save wrote; from an hf copy (no box reads: rows read and cut) too."""
    flags = ["--placement", "model.cube=S2,S1", "--placement", "model.cols=R,S1"]
    saved, _, _ = _grids(golden)
    hf = str(tmp_path / "hf")
    assert _cli("convert", golden, hf, "--to", "hf", *_AS_SAVED["hf"], "-q")[0] == 0
    for src in (golden, hf):
        out = str(tmp_path / f"mesh-{pathlib.Path(src).name}")
        code, _, err = _cli("reshard", src, out, "--mesh", "2x2", *flags, "-q")
        assert code == 0, err
        grids, _, _ = _grids(out, STEP if src == golden else 0)
        assert {n: g for n, g in grids.items() if n != "model.up"} == {
            n: g for n, g in saved.items() if n != "model.up"
        }
        _same(storage.load_state_dict(out))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "2", "--placement", "*=S0"], "--placement applies with --mesh only"),
        (["--mesh", "2x2", "--placement", "*=S0"], "gives 1 placements for the 2 dims"),
        (["--mesh", "2x2", "--placement", "model.bias=S1,R"], "'model.bias' (1 dims) cannot"),
        (["--mesh", "2x0"], "mesh '2x0' must be mesh dim sizes >= 1"),
        (["--world-size", "1000000000"], "world_size=1000000000 is more than 1048576 ranks"),
        (["--mesh", "2x2", "--placement", "*=S0,P"], "must be PATTERN=SPEC"),
        (["--mesh", "2", "--world-size", "2"], "not allowed with argument"),
        (["--to", "hf", "--mesh", "2"], "--mesh applies to --to ftsdp only, not hf"),
    ],
)
def test_reshard_mesh_usage_errors(
    golden: str, tmp_path: pathlib.Path, argv: list[str], message: str
) -> None:
    command = "convert" if "--to" in argv else "reshard"
    code, out, err = _cli(command, golden, str(tmp_path / "out"), *argv, "-q")
    assert code == 2 and message in err and not out, err
    assert not (tmp_path / "out").exists()
