"""``ftsdp-ckpt`` in process: inspect, verify (clean and damaged), diff, gc, and every bad input
named by the issue getting one line ``ftsdp-ckpt: error: ...`` and exit code 2."""

from __future__ import annotations

import io
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main

SMALL = storage.SaveOptions(checksum_block_bytes=64, object_bytes=4000)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 30, generator=g)
    w[0, : step - 1] += 0.5  # steps differ in a few elements
    return {
        "model": {"w": w, "b": torch.zeros(30, dtype=torch.bfloat16), "n": torch.arange(4)},
        "optim": {"m": torch.ones(20, 30) * step},
        "trainer": {"step": step},
    }


@pytest.fixture
def root(tmp_path: pathlib.Path) -> pathlib.Path:
    for step in (1, 2, 3, 4):
        storage.save(_state(step), str(tmp_path / "ckpt"), step=step, options=SMALL)
    torn = tmp_path / "ckpt" / "step-0"  # an attempt that never committed, older than step 4
    torn.mkdir()
    (torn / "rank00000-000-deadbeef.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "ckpt" / "step-9").mkdir()  # newer than the newest commit: maybe in progress
    return tmp_path / "ckpt"


def test_inspect_text_and_json(root: pathlib.Path) -> None:
    """A summary by name group (model, optimizer state) by default; every tensor with
    --tensors; everything with --json."""
    code, out, _ = _cli("inspect", str(root))
    assert code == 0
    assert "committed steps: [1, 2, 3, 4]" in out and "torn steps: [0, 9]" in out
    assert "step 4, saved at world size 1" in out and "values: trainer.step" in out
    groups = {line.split()[0]: line.split() for line in out.splitlines()[4:6]}
    # model: w (20x30 float32), b (30 bfloat16), n (4 int64); optim: m (20x30 float32)
    assert groups["model"][1:3] == ["3", "tensors"] and groups["optim"][1:3] == ["1", "tensors"]
    assert "2.4 KiB" in " ".join(groups["model"]) and "bfloat16 1, float32 1, int64 1" in out
    assert "total: 4 tensors" in out and "(4892 bytes)" in out
    assert "model.w" not in out and "--tensors" in out  # the table only on request
    code, out, _ = _cli("inspect", str(root), "--tensors")
    assert code == 0 and out.startswith("ftsdp checkpoint") and "total: 4 tensors" in out
    table = {line.split()[0]: line for line in out.splitlines() if line.startswith("model.")}
    assert sorted(table) == ["model.b", "model.n", "model.w"]
    assert "[20, 30]" in table["model.w"] and "float32" in table["model.w"]
    assert (
        table["model.w"].split()[-3:] == ["2400", "1", "piece"] and "bfloat16" in table["model.b"]
    )
    code, out, _ = _cli("inspect", str(root), "--step", "2", "--json")
    assert code == 0
    info = json.loads(out)
    assert info["step"] == 2 and info["world_size"] == 1 and info["torn_steps"] == [0, 9]
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["model.b"] == {
        "name": "model.b",
        "shape": [30],
        "dtype": "bfloat16",
        "bytes": 60,
        "layout": {"pieces": 1},
    }
    assert info["total_bytes"] == sum(t["bytes"] for t in info["tensors"]) == 2400 + 60 + 32 + 2400


def test_inspect_shows_grids_and_rules_of_the_v5_golden(tmp_path: pathlib.Path) -> None:
    """Each tensor's saved layout of the golden N-D checkpoint (4 ranks on a 2 x 2 mesh): the
    grid (cuts, cells per dim) of the boxes, the layout rule, else the pieces listed."""
    from tests.make_storage_golden_v5 import GOLDEN_V5

    code, out, _ = _cli("inspect", str(GOLDEN_V5), "--json")
    assert code == 0
    layout = {t["name"]: t["layout"] for t in json.loads(out)["tensors"]}
    assert layout["model.down"] == {"grid": [[0, 3, 5], [0, 4, 7]], "cells": [2, 2], "pieces": 6}
    assert layout["model.cols"] == {"grid": [[0, 4], [0, 3, 6]], "cells": [1, 2], "pieces": 2}
    assert layout["model.cube"]["grid"] == [[0, 2], [0, 2, 4], [0, 3, 6]]
    assert layout["model.cube"]["cells"] == [1, 2, 2]
    assert layout["model.even"] == {
        "grid": [[0, 2, 4], [0, 3, 6]],
        "cells": [2, 2],
        "rule": {"kind": "even", "start": 0, "chunk": 6},
    }
    assert layout["model.up"] == {"pieces": 5} and layout["model.bias"] == {"pieces": 2}
    code, out, _ = _cli("inspect", str(GOLDEN_V5), "--tensors")
    assert code == 0
    assert (
        "layouts: 4 on a grid (N-D shards), 2 row-major; 1 by a layout rule, 5 listing their pieces"
    ) in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("model.")}
    assert rows["model.down"].endswith("grid 2x2, cells 3|2 x 4|3, 6 pieces")
    assert rows["model.even"].endswith("grid 2x2, cells 2 x 3, even rule (chunk 6)")
    assert rows["model.cube"].endswith("grid 1x2x2, cells 2 x 2 x 3, 7 pieces")
    assert rows["model.up"].endswith("5 pieces") and "grid" not in rows["model.up"]


def test_inspect_help_describes_its_arguments() -> None:
    code, out, _ = _cli_exit("inspect", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "url a checkpoint: an ftsdp root or step directory" in text
    assert "--step STEP ftsdp: the committed step to describe (default: the newest)" in text
    assert "--tensors also list every tensor" in text


def _cli_exit(*argv: str) -> tuple[int, str, str]:
    """:func:`_cli` for ``--help`` and ``--version``, which exit through SystemExit."""
    out = io.StringIO()
    old, sys.stdout = sys.stdout, out
    try:
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = int(e.code or 0)
    finally:
        sys.stdout = old
    return code, out.getvalue(), ""


def test_help_and_usage_errors_do_not_import_torch() -> None:
    """``--help`` and a bad command line answer without importing torch (2 s of imports),
    and the storage constants they show are storage's own."""
    from ftsdp.tools.ckpt import _args

    assert _args.DEFAULT_MAX_MEMORY == storage.io.DEFAULT_MAX_MEMORY
    assert _args.FORMATS == storage.conversion.FORMATS
    assert _args.GRACE_S == storage.catalog.GRACE_S
    proc = _answer_without_torch(
        "ftsdp.tools.ckpt",
        "ftsdp-ckpt",
        [["--help"], ["inspect", "--help"], ["convert", "--help"], ["nope"]],
        codes=(0, 2),
        also_absent="ftsdp.storage",
    )
    assert "usage: ftsdp-ckpt" in proc.stdout and "invalid choice: 'nope'" in proc.stderr
    proc = _answer_without_torch("ftsdp.train", "ftsdp-train", [["--help"], ["--version"]])
    assert "usage: ftsdp-train" in proc.stdout and "--global-batch" in proc.stdout


def _answer_without_torch(
    module: str,
    prog: str,
    argvs: list[list[str]],
    codes: tuple[int, ...] = (0,),
    also_absent: str = "torch",
) -> subprocess.CompletedProcess:
    """Run ``module`` as ``prog`` with each of ``argvs`` in one fresh interpreter; each exits
    with one of ``codes``, and neither torch nor ``also_absent`` was imported."""
    script = (
        "import sys, runpy\n"
        f"for argv in {argvs!r}:\n"
        f"    sys.argv = [{prog!r}, *argv]\n"
        "    try:\n"
        f"        runpy.run_module({module!r}, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        f"        assert e.code in {codes!r}, (argv, e.code)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        f"assert {also_absent!r} not in sys.modules, '{also_absent} imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_verify_clean_and_damaged(root: pathlib.Path) -> None:
    code, out, _ = _cli("verify", str(root))
    assert code == 0 and out.startswith("OK") and "step(s) 1, 2, 3, 4" in out
    m3 = storage.catalog.read_manifest(str(root), 3)
    piece = m3.tensors["model.w"].pieces[0]
    obj = root / "step-3" / piece.object
    data = bytearray(obj.read_bytes())
    data[piece.byte_start + 100] ^= 0xFF  # flip a byte inside block 1 of the piece
    obj.write_bytes(bytes(data))
    m2 = storage.catalog.read_manifest(str(root), 2)
    (root / "step-2" / m2.tensors["optim.m"].pieces[0].object).unlink()
    code, out, _ = _cli("verify", str(root))
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert code == 1 and out.splitlines()[-1].startswith("FAILED (2 problems)")
    assert any(
        "step 3: tensor model.w: checksum mismatch" in p and "bytes [" in p for p in problems
    )
    assert any("step 2: object" in p and "is missing" in p for p in problems)
    code, out, _ = _cli("verify", str(root), "--step", "4", "--json")
    assert code == 0 and json.loads(out)["checked"] == [4]


def test_diff_names_changed_tensors(root: pathlib.Path) -> None:
    code, out, _ = _cli("diff", str(root), "1", "3")
    assert code == 0
    assert "changed  model.w 2/600 elements, max abs diff 0.5" in out
    assert "changed  optim.m 600/600 elements, max abs diff 2" in out
    assert "value    trainer.step: 1 -> 3" in out
    assert out.splitlines()[-1] == "step 1 -> 3: 2 changed, 2 same; 1 values differ"
    code, out, _ = _cli("diff", str(root), "1", "3", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)["tensors"]}
    assert rows["model.w"]["status"] == "changed" and rows["optim.m"]["status"] == "changed"
    assert {r["status"] for r in rows.values()} == {"changed", "same"}
    rows = {
        r["name"]: r for r in json.loads(_cli("diff", str(root), "2", "2", "--json")[1])["tensors"]
    }
    assert {r["status"] for r in rows.values()} == {"same"}


def test_gc_dry_run_then_real(root: pathlib.Path) -> None:
    code, out, _ = _cli("gc", str(root), "--keep-last", "2", "--dry-run", "--grace-s", "0")
    assert code == 0 and "would remove steps [0, 1, 2]" in out and "kept steps [3, 4]" in out
    assert "kept torn steps [9]" in out
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-0", "step-1", "step-2", "step-3", "step-4", "step-9",
    ]  # fmt: skip
    code, out, _ = _cli("gc", str(root), "--keep-last", "2", "--grace-s", "0")
    assert code == 0 and "removed steps [0, 1, 2]" in out
    assert storage.list_steps(str(root)) == [3, 4]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-3",
        "step-4",
        "step-9",
    ]
    code, out, _ = _cli("gc", str(root))  # nothing left to collect
    assert code == 0 and "removed steps none" in out


BAD = {
    "unknown format": (["convert", "{root}", "{tmp}/o", "--to", "onnx"], "unknown format 'onnx'"),
    "unknown source format": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--from", "x"],
        "unknown format 'x'",
    ),
    "missing step": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--step", "7"],
        "step 7 is not committed",
    ),
    "missing step (inspect)": (["inspect", "{root}", "--step", "7"], "step 7 is not committed"),
    "missing source": (["convert", "{tmp}/nope", "{tmp}/o", "--to", "hf"], "does not exist"),
    "not a checkpoint": (["inspect", "{tmp}/empty"], "no checkpoint found"),
    "dst holds one": (
        ["convert", "{root}", "{tmp}/taken", "--to", "hf"],
        "already holds a hf checkpoint; pass overwrite",
    ),
    "world size with hf": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--world-size", "2"],
        "conflicts with --to hf",
    ),
    "shard size with torch": (
        ["convert", "{root}", "{tmp}/o.pt", "--to", "torch", "--max-shard-size", "1MB"],
        "conflicts with --to torch",
    ),
    "same src and dst": (["convert", "{root}", "{root}", "--to", "ftsdp"], "same location"),
    "step of a non-ftsdp source": (
        ["convert", "{tmp}/taken", "{tmp}/o", "--to", "ftsdp", "--step", "1"],
        "has no steps",
    ),
    "verify a missing root": (["verify", "{tmp}/nope"], "does not exist"),
    "gc a missing root": (["gc", "{tmp}/nope", "--dry-run"], "does not exist"),
    "diff a missing step": (["diff", "{root}", "1", "5"], "step 5 is not committed"),
    "bad dtype": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--dtype", "int8"],
        "unknown dtype 'int8'",
    ),
    "bad rename": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--rename", "model."],
        "must be OLD=NEW",
    ),
    "rename collision": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--rename", "model.b=w"],  # model.w -> w
        "both become 'w'",
    ),
    "tiny budget": (
        ["convert", "{root}", "{tmp}/o", "--to", "hf", "--max-memory", "1MB"],
        "max_memory=1000000 is too small",
    ),
    "corrupt source": (
        ["convert", "{tmp}/corrupt", "{tmp}/o", "--to", "hf"],
        "checksum mismatch in tensor 'model.w'",
    ),
    "corrupt manifest": (
        ["convert", "{tmp}/badjson", "{tmp}/o", "--to", "hf"],
        "manifest is not valid JSON",
    ),
    "truncated hf": (["inspect", "{tmp}/trunc.safetensors"], "truncated or corrupt"),
    "reshard without world size": (
        ["reshard", "{root}", "{tmp}/o"],
        "one of the arguments --world-size --mesh is required",
    ),
    "no command": ([], "required: command"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A good root, an hf destination that is taken, damaged sources, an empty directory."""
    tmp = tmp_path_factory.mktemp("bad")
    for step in (1, 2):
        storage.save(_state(step), str(tmp / "root"), step=step, options=SMALL)
    storage.conversion.convert(str(tmp / "root"), str(tmp / "taken"), to="hf")
    storage.save(_state(1), str(tmp / "corrupt"), step=1, options=SMALL)
    piece = storage.catalog.read_manifest(str(tmp / "corrupt")).tensors["model.w"].pieces[0]
    obj = tmp / "corrupt" / "step-1" / piece.object
    data = bytearray(obj.read_bytes())
    data[piece.byte_start] ^= 1
    obj.write_bytes(bytes(data))
    storage.save(_state(1), str(tmp / "badjson"), step=1)
    (tmp / "badjson" / "step-1" / "manifest.json").write_text("{nope")
    hf = (tmp / "taken" / "model.safetensors").read_bytes()
    (tmp / "trunc.safetensors").write_bytes(hf[: len(hf) // 2])
    (tmp / "empty").mkdir()
    return tmp


def _files(folder: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_and_exit_2(inputs: pathlib.Path, case: str) -> None:
    argv, message = BAD[case]
    argv = [a.format(root=inputs / "root", tmp=inputs) for a in argv]
    before = _files(inputs)
    code, out, err = _cli(*argv)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("ftsdp-ckpt: error: "), err
    assert message in err, err
    assert out == ""
    assert _files(inputs) == before  # nothing was written, nothing removed


@pytest.mark.timeout(120)
def test_closed_pipe_ends_quietly(tmp_path) -> None:
    """`ftsdp-ckpt inspect URL | head -1`: no traceback, no error line, exit 0."""
    import subprocess
    import sys

    url = str(tmp_path / "many")
    storage.save({f"t{i:05d}": torch.zeros(1) for i in range(4000)}, url, step=1)  # > pipe buffer
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftsdp.tools.ckpt", "inspect", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=pathlib.Path(__file__).resolve().parents[4],
    )
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=100) == 0
    assert proc.stderr.read() == b""


def test_verify_a_step_directory(root: pathlib.Path) -> None:
    """`verify ROOT/step-N` checks step N of the ftsdp root (it used to be taken for an hf
    directory of loose .safetensors files, whose data has no checksums, and pass)."""
    code, out, _ = _cli("verify", str(root / "step-3"))
    assert code == 0 and out.startswith("OK: ftsdp") and "step(s) 3," in out
    code, out, _ = _cli("inspect", str(root / "step-3"), "--json")
    assert code == 0 and json.loads(out)["format"] == "ftsdp" and json.loads(out)["step"] == 3
    piece = storage.catalog.read_manifest(str(root), 3).tensors["model.w"].pieces[0]
    obj = root / "step-3" / piece.object
    data = bytearray(obj.read_bytes())
    data[piece.byte_start] ^= 1
    obj.write_bytes(bytes(data))
    code, out, _ = _cli("verify", str(root / "step-3"))
    assert code == 1 and "step 3: tensor model.w: checksum mismatch" in out
    assert out.splitlines()[-1].startswith("FAILED (1 problems): ftsdp")
    code, out, err = _cli("verify", str(root / "step-3"), "--step", "2")
    assert code == 2 and "is the directory of step 3, but step 2" in err and out == ""
    odd = root.parent / "odd"  # a manifest in a directory that is not step-<N>
    odd.mkdir()
    (odd / "manifest.json").write_bytes((root / "step-1" / "manifest.json").read_bytes())
    code, out, err = _cli("verify", str(odd))
    assert code == 2 and "is not a step-<N> directory" in err and err.count("\n") == 1
    (odd / "manifest.json").write_text('{"name": "not ours"}')  # someone else's manifest.json
    code, out, err = _cli("verify", str(odd))
    assert code == 2 and "no checkpoint found" in err  # not taken for a step directory


def test_verify_a_manifest_of_another_step(root: pathlib.Path) -> None:
    """A manifest whose step is not its directory's is a problem (loaders refuse it)."""
    from ftsdp.storage.format._manifest import seal

    path = root / "step-2" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["step"] = 5
    path.write_text(json.dumps(seal(doc)))
    code, out, _ = _cli("verify", str(root))
    assert code == 1 and "PROBLEM: step 2:" in out and "says step 5" in out
    with pytest.raises(storage.CorruptCheckpointError, match="manifest says step 5"):
        storage.load_state_dict(str(root), step=2)


def test_exit_codes_are_distinct(root: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0 ok, 1 problems found, 2 bad usage or input, 3 internal error (one line, and the
    traceback only with --debug)."""
    assert _cli("verify", str(root))[0] == 0
    assert _cli("verify", str(root), "--bogus")[0] == 2
    assert _cli("verify", str(root / "nope"))[0] == 2

    def broken(**kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(storage.catalog, "verify", broken)
    code, out, err = _cli("verify", str(root))
    assert code == 3 and out == "" and err.count("\n") == 1
    assert err.startswith("ftsdp-ckpt: internal error: RuntimeError: boom second line")
    assert "--debug" in err and "report" in err and "Traceback" not in err
    code, out, err = _cli("verify", str(root), "--debug")
    assert code == 3 and "Traceback (most recent call last)" in err and "in broken" in err
    assert err.splitlines()[-1].startswith("ftsdp-ckpt: internal error: RuntimeError: boom")
    monkeypatch.setattr(
        storage.catalog, "verify", lambda **kw: (_ for _ in ()).throw(RecursionError())
    )
    assert _cli("verify", str(root))[0] == 3  # not the 1 of "problems found"


def test_one_parser_serves_every_call_and_keeps_no_state(root: pathlib.Path) -> None:
    """``main`` builds its parser once per process (the fuzz tool calls it once per case); a
    call's options do not leak into the next: an ``-o`` given once is gone the next time, and a
    bad line between two good ones changes neither."""
    from ftsdp.tools.ckpt._args import _parser, parse

    first = parse(["verify", str(root), "-o", "anon=true"])
    assert first.storage_options == {"anon": True}
    assert _cli("verify", str(root), "--no-such-flag")[0] == 2
    again = parse(["verify", str(root)])
    assert again.storage_option == [] and again.storage_options is None
    assert _parser() is _parser()
    code, out, _ = _cli("verify", str(root))
    assert code == 0 and "step(s) 1, 2, 3, 4" in out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_only_and_not_with_quiet(root: pathlib.Path, monkeypatch) -> None:
    """A bar (bytes read of the total, rate, ETA) on stderr when it is a terminal, ended by one
    newline; ``-q`` and a pipe draw nothing."""
    for stream, argv, drawn in (
        (_Terminal(), [], True),
        (_Terminal(), ["-q"], False),
        (io.StringIO(), [], False),
    ):
        monkeypatch.setattr(sys, "stderr", stream)
        assert _cli("verify", str(root), "--step", "4", *argv)[0] == 0
        text = stream.getvalue()
        assert text == "" or drawn, text
        if drawn:  # the last redraw: every byte read
            assert text.startswith("\rverify [") and text.endswith("\x1b[K\n"), text
            last = re.match(
                r"verify \[(#*)-*\] 100% (\S+ \S+)/(\S+ \S+) .*/s ETA 0:00:00",
                text.rsplit("\r")[-1],
            )
            assert last and len(last[1]) == 24 and last[2] == last[3], text


def test_control_characters_in_names_are_escaped_in_text_and_exact_in_json(tmp_path) -> None:
    """A tensor named with an escape sequence and a carriage return (which on a terminal would
    erase the line and print a forged one over it), and a stray file named so: the text output
    of inspect, verify and gc shows them escaped, with no raw control character; --json keeps
    the exact name."""
    name = "model.evil\x1b[2K\rOK: all good"
    shown = "model.evil\\x1b[2K\\rOK: all good"
    url = str(tmp_path / "ckpt")
    for step in (1, 2):
        storage.save({"model": {"evil\x1b[2K\rOK: all good": torch.ones(10)}}, url, step=step)
    (tmp_path / "ckpt" / "step-0").mkdir()
    (tmp_path / "ckpt" / "step-0" / "x\x1b]0;title\x07").write_bytes(b"1")
    piece = storage.catalog.read_manifest(url, 2).tensors[name].pieces[0]
    obj = tmp_path / "ckpt" / "step-2" / piece.object
    data = bytearray(obj.read_bytes())
    data[piece.byte_start] ^= 0xFF
    obj.write_bytes(bytes(data))

    def raw_controls(text: str) -> list[str]:
        return [c for c in text if not c.isprintable() and c != "\n"]

    code, out, _ = _cli("inspect", url, "--tensors")
    assert code == 0 and shown in out and not raw_controls(out), out
    code, out, _ = _cli("verify", url)
    assert code == 1 and not raw_controls(out), out
    assert any(line.startswith("PROBLEM: step 2: tensor " + shown) for line in out.splitlines())
    code, out, _ = _cli("gc", url, "--dry-run")
    assert code == 0 and "x\\x1b]0;title\\x07" in out and not raw_controls(out), out
    code, out, _ = _cli("inspect", url, "--json")
    assert [t["name"] for t in json.loads(out)["tensors"]] == [name]
    code, out, _ = _cli("verify", url, "--json")
    assert any(name in p for p in json.loads(out)["problems"])


def test_diff_compares_integers_exactly(tmp_path: pathlib.Path) -> None:
    """int64 values above 2**53 (counters, seeds, hashed ids) that differ by one are changed,
    as torch.equal says; float64 would hold them as one number."""
    url = str(tmp_path / "ck")
    a = {"ids": torch.tensor([2**60, 7, -(2**62)]), "seed": torch.tensor(2**62)}
    b = {"ids": torch.tensor([2**60 + 1, 7, -(2**62) - 3]), "seed": torch.tensor(2**62 + 100)}
    storage.save(a, url, 1)
    storage.save(b, url, 2)
    rows = {r["name"]: r for r in storage.catalog.diff(url, 1, url, 2)["tensors"]}
    for name in a:
        assert not torch.equal(a[name], b[name])
        assert rows[name]["status"] == "changed", rows[name]
    assert rows["ids"]["changed"] == 2 and rows["seed"]["changed"] == 1
    assert rows["ids"]["max_abs_diff"] >= 1
    same = storage.catalog.diff(url, 2, url, 2)["tensors"]
    assert {r["status"] for r in same} == {"same"}


@pytest.mark.parametrize("to", ["ftsdp", "hf", "torch", "dcp"])
def test_two_values_renamed_onto_one_name_are_refused(tmp_path: pathlib.Path, to: str) -> None:
    """As for tensors: ``--rename old.=new.`` on values ``old.lr`` and ``new.lr`` would keep
    one of them and drop the other with exit 0; it exits 2 naming both, writing nothing (hf
    keeps values with ``--include-optimizer``)."""
    src, out = tmp_path / "src", tmp_path / "out"
    storage.save({"w": torch.ones(2), "old": {"lr": 0.1}, "new": {"lr": 0.5}}, str(src), 3)
    extra = ["--include-optimizer"] if to == "hf" else []
    args = ["convert", str(src), str(out), "--to", to, "--rename", "old.=new.", *extra]
    code, _, err = _cli(*args)
    assert code == 2 and "values 'new.lr' and 'old.lr' both become 'new.lr'" in err, err
    assert not out.exists()


def test_diff_reports_infinities_and_nan_values_as_they_are(tmp_path: pathlib.Path) -> None:
    """An element that became inf differs by inf (not by the largest double); a NaN value is
    the same NaN in both steps; inf against -inf differs by inf; --json is strict JSON (what
    JSON cannot hold is written as a string)."""
    root = str(tmp_path / "ckpt")
    storage.save({"w": torch.tensor([1.0, 2.0, 3.0]), "loss": float("nan")}, root, 1)
    inf = float("inf")
    storage.save({"w": torch.tensor([inf, 2.0, -inf]), "loss": float("nan")}, root, 2)
    code, out, _ = _cli("diff", root, "1", "2")
    assert code == 0 and "max abs diff inf" in out and "0 values differ" in out, out
    code, out, _ = _cli("diff", root, "1", "1")
    assert "1 same; 0 values differ" in out, out
    code, out, _ = _cli("diff", root, "1", "2", "--json")
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c} in --json"))
    (row,) = doc["tensors"]
    assert row["changed"] == 2 and row["max_abs_diff"] == "Infinity", row
    storage.save({"w": torch.tensor([-inf, 2.0, inf]), "loss": 0.5}, root, 3)
    code, out, _ = _cli("diff", root, "2", "3")
    assert "2/3 elements, max abs diff inf" in out and "1 values differ" in out, out
