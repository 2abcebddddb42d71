"""Fuzz the hf, torch and dcp sources of ``ftsdp-ckpt inspect`` and ``convert``.

    python -m ftsdp.tools.dev.fuzz_sources --cases 3000 --seed 1      # a table of outcomes
    python -m ftsdp.tools.dev.fuzz_sources --seed 1 --case 17 -v      # replay one case

Small checkpoints of each source format (an hf file, an hf folder with an index and two shards,
a ``torch.save`` file, a DCP folder) are written once. Each case copies one, damages it (bit
flips, truncation; a hostile value at a random place of a safetensors header, of its
``ftsdp.values`` or of the hf index, the header length prefix kept right) or writes a hostile
state (deep nesting of dicts, lists and values, odd keys and values) in the format, then runs
``inspect``, ``inspect --json``, ``convert --to ftsdp`` and ``convert --to hf`` in process.

The oracle: each command exits 0 or 2 (bad input), never 3 (an internal error) nor by an
exception; exit 2 prints exactly one line ``ftsdp-ckpt: error: ...``. A failed ``convert --to
ftsdp`` commits nothing (no manifest); a successful one commits a step that ``inspect`` and
``verify`` accept (exit 0).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import struct
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftsdp.tools.ckpt import main as ckpt_main

DEEP = 3000  # deeper than Python's recursion limit
HOSTILE: list[Any] = [
    "abcd", "[1,2]", "", "F32", "BOGUS", -1, 0, 2**63, -(2**63), 10**30, 1.5, None, True,
    [], [-1, -4], [1, 2], ["a"], [2**64], {}, {"a": 1}, {"a": "b"},
    "[" * 200_000 + "]" * 200_000, '{"a":' * 1000 + "1" + "}" * 1000,
]  # fmt: skip
FORMATS = ("hf", "hf-index", "torch", "dcp")


def _deep(leaf: Any, kind: type = list, depth: int = DEEP) -> Any:
    out = leaf
    for _ in range(depth):
        out = [out] if kind is list else {"a": out}
    return out


def _state(rng: random.Random) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.arange(5, dtype=torch.int16),
        "cfg": {"lr": 0.5, "name": "tiny", "sizes": [1, [2, 3]]},
    }


def _hostile_state(rng: random.Random, deepest: int = DEEP) -> dict[str, Any]:
    """A state whose structure, not its bytes, is hostile (nested at most ``deepest``)."""
    state = _state(rng)
    depth = rng.choice([d for d in (2, 63, 64, 65, 200, DEEP) if d <= deepest])
    match rng.randrange(5):
        case 0:  # tensors under deep dicts
            state["deep"] = _deep({"t": torch.ones(2)}, dict, depth)
        case 1:  # a deep non-tensor value
            state["v"] = _deep(1, rng.choice([list, dict]), depth)
        case 2:  # tensors in deep lists
            state["l"] = _deep([torch.ones(2)], list, depth)
        case 3:
            state["odd"] = {1: torch.ones(1), "x.y": rng.choice(HOSTILE[:22]), "": 2}
        case _:
            state["t"] = (torch.ones(2), float("nan"), 2**80)
    return state


def _header(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _with_header(header: Any, rest: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + rest


def _poke(doc: Any, rng: random.Random) -> Any:
    """``doc`` with a hostile value at a random place (the whole of it, a key's value, or one
    level further down)."""
    value = rng.choice(HOSTILE)
    if not isinstance(doc, dict) or not doc or rng.random() < 0.1:
        return value
    key = rng.choice(sorted(doc))
    if isinstance(doc[key], dict) and doc[key] and rng.random() < 0.7:
        doc[key][rng.choice(sorted(doc[key]))] = value
    else:
        doc[key] = value
    return doc


@dataclass
class Case:
    index: int
    fmt: str
    kind: str
    outcome: str = ""
    failure: str = ""


class Fuzzer:
    """The clean sources (written once into ``workdir``) and one case at a time."""

    def __init__(self, workdir: Path, seed: int) -> None:
        self.work, self.seed = workdir, seed
        rng = random.Random(seed)
        from ftsdp import storage  # the writers of the clean sources

        clean = workdir / "clean"
        clean.mkdir(parents=True)
        storage.save(_state(rng), str(clean / "root"), step=1)
        self.clean = {
            "hf": clean / "m.safetensors",
            "hf-index": clean / "hfdir",
            "torch": clean / "m.pt",
            "dcp": clean / "dcp",
        }
        storage.conversion.convert(str(clean / "root"), str(self.clean["hf"]), to="hf")
        storage.conversion.convert(
            str(clean / "root"), str(self.clean["hf-index"]), to="hf", max_shard_bytes=40
        )
        torch.save(_state(rng), self.clean["torch"])
        self._dcp_save(_state(rng), self.clean["dcp"])

    @staticmethod
    def _dcp_save(state: dict[str, Any], path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(path), no_dist=True)

    def make(self, case: Case, rng: random.Random, at: Path) -> Path:
        """Write case ``case``'s damaged source under ``at``; its path."""
        clean = self.clean[case.fmt]
        src = at / clean.name
        if case.kind == "state":
            if case.fmt == "torch":
                state = _hostile_state(rng)
                limit = sys.getrecursionlimit()
                sys.setrecursionlimit(max(limit, 4 * DEEP))  # the pickler recurses
                try:
                    torch.save(state, src)
                finally:
                    sys.setrecursionlimit(limit)
                return src
            self._dcp_save(_hostile_state(rng, deepest=200), src)  # DCP's planner recurses
            return src
        if clean.is_dir():
            shutil.copytree(clean, src)
        else:
            shutil.copy(clean, src)
        files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
        target = rng.choice(files)
        data = target.read_bytes()
        if case.kind == "flip":
            buf = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(buf))
                buf[i] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(buf))
        elif case.kind == "truncate":
            target.write_bytes(data[: rng.randrange(len(data))])
        elif case.kind == "index":
            index = src / "model.safetensors.index.json"
            index.write_text(json.dumps(_poke(json.loads(index.read_text()), rng)))
        else:  # a safetensors header: its entries, __metadata__ or ftsdp.values
            shards = [p for p in files if p.suffix == ".safetensors"]
            target = rng.choice(shards)
            header, rest = _header(target.read_bytes())
            meta = header.get("__metadata__", {})
            if case.kind == "values" and "ftsdp.values" in meta:
                values = json.loads(meta["ftsdp.values"])
                poked = _poke(values, rng)
                meta["ftsdp.values"] = poked if rng.random() < 0.3 else json.dumps(poked)
            else:
                header = _poke(header, rng)
            target.write_bytes(_with_header(header, rest))
        return src

    def check(self, case: Case, src: Path, at: Path) -> None:
        """Run the commands on ``src``; ``case.failure`` says how the oracle broke, if it did."""
        outcomes = []
        for name, argv in [
            ("inspect", ["inspect", str(src)]),
            ("inspect-json", ["inspect", str(src), "--json"]),
            ("ftsdp", ["convert", str(src), str(at / "out"), "--to", "ftsdp", "-q"]),
            ("hf", ["convert", str(src), str(at / "out-hf"), "--to", "hf", "-q"]),
        ]:
            code, err = _cli(argv)
            outcomes.append(f"{name}:{code}")
            if code not in (0, 2):
                case.failure = f"{' '.join(argv)}: exit {code}\n{err}"
                return
            if code == 2 and not (err.count("\n") == 1 and err.startswith("ftsdp-ckpt: error: ")):
                case.failure = f"{' '.join(argv)}: exit 2 without one error line:\n{err}"
                return
            if name != "ftsdp":
                continue
            out = at / "out"
            if code == 2 and out.exists() and any(out.rglob("manifest.json")):
                case.failure = f"{' '.join(argv)} failed but committed a step"
                return
            if code == 0:
                for check in (["inspect", str(out)], ["verify", str(out)]):
                    c, e = _cli(check)
                    if c != 0:
                        case.failure = f"convert committed a step that {check[0]} refuses:\n{e}"
                        return
        case.outcome = " ".join(outcomes)


def _cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    try:
        code = ckpt_main(argv, out=out, err=err)
    except BaseException:
        return -1, traceback.format_exc()
    return code, err.getvalue()


KINDS = {
    "hf": ["flip", "truncate", "header", "header", "values", "values"],
    "hf-index": ["flip", "truncate", "header", "values", "index", "index"],
    "torch": ["flip", "truncate", "state", "state", "state"],
    "dcp": ["flip", "truncate", "state", "state"],
}


@dataclass
class Summary:
    cases: list[Case]

    @property
    def failures(self) -> list[Case]:
        return [c for c in self.cases if c.failure]

    def table(self) -> str:
        counts = Counter((c.fmt, c.kind, c.outcome or "FAILED") for c in self.cases)
        return "\n".join(f"{n:6d}  {f:<9} {k:<9} {o}" for (f, k, o), n in sorted(counts.items()))


def run(cases: int, seed: int, workdir: str | None = None, only: int | None = None) -> Summary:
    """Run ``cases`` cases (or case ``only``) from ``seed``; their outcomes."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        fuzzer = Fuzzer(Path(tmp), seed)
        done = []
        for i in range(cases) if only is None else [only]:
            rng = random.Random(f"{seed}:{i}")
            fmt = FORMATS[i % len(FORMATS)]
            case = Case(i, fmt, rng.choice(KINDS[fmt]))
            at = Path(tmp) / f"case-{i}"
            at.mkdir()
            try:
                case_src = fuzzer.make(case, rng, at)
                fuzzer.check(case, case_src, at)
            finally:
                shutil.rmtree(at)
            done.append(case)
        return Summary(done)


def describe(c: Case, seed: int) -> str:
    """How case ``c`` broke the oracle, and the command line that replays it."""
    return (
        f"case {c.index} ({c.fmt}, {c.kind}): {c.failure}\n"
        f"replay: python -m ftsdp.tools.dev.fuzz_sources --seed {seed} --case {c.index} -v"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, default=None, help="replay one case")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    summary = run(args.cases, args.seed, only=args.case)
    print(summary.table())
    for c in summary.failures[: None if args.verbose else 5]:
        print("\n" + describe(c, args.seed))
    print(f"{len(summary.failures)} of {len(summary.cases)} cases broke the oracle")
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
