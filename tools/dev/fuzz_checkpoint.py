"""Fuzz the checkpoint reader: random damage to a small checkpoint, then load it.

    python -m ftsdp.tools.dev.fuzz_checkpoint --cases 20000 --seed 1      # a table of outcomes
    python -m ftsdp.tools.dev.fuzz_checkpoint --seed 1 --case 4711 -v     # replay one case
    python -m ftsdp.tools.dev.fuzz_checkpoint --sharded --cases 5000      # a 3-rank, version 4 one
    python -m ftsdp.tools.dev.fuzz_checkpoint --grid --cases 5000         # the version 5 golden

A tiny checkpoint (a few small tensors of several dtypes spread over several objects, an empty
tensor, nested non-tensor values) is saved once. Each case copies it, applies one random
mutation and reads it back three ways: ``storage.load`` into a zeroed copy of the state,
``storage.load_state_dict`` and ``storage.catalog.verify`` (and ``ftsdp-ckpt verify``). Mutations: bit flips, truncations and
appended bytes in any file; edits of the manifest's JSON (numbers, types, deleted or renamed
keys, object names, dtypes, deep nesting, huge numbers), resealed with a valid manifest checksum
or not; removed, renamed, extra, linked (outside the checkpoint, to devices, dangling, looping)
files and directories.

The oracle, for every case: each read returns exactly the saved values (every tensor bitwise,
every value) or raises a ``CheckpointError``; a failed ``load`` leaves its target untouched;
``verify`` returns a report or raises a ``CheckpointError``, and reports no problem only when
the loads returned the saved values; ``ftsdp-ckpt verify`` exits 0, 1 or 2 as that report says
(never 3, an internal error). Anything else (another exception, a wrong value, a hang
caught by the caller's timeout) is a failure, printed with the seed and case that replay it.
One exception to "exactly the saved values": a resealed edit of what the manifest says a tensor
or value *is* (a dtype, a value) is a different, valid checkpoint (the manifest checksum detects
damage, not deliberate edits); for those only the exception rule holds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import torch

from ftsdp import storage
from ftsdp.tools.ckpt import main as ckpt_main

STEP = 1
OPTIONS = storage.SaveOptions(object_bytes=96, checksum_block_bytes=32)
DTYPES = [
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64",
    "int32", "int16", "int8", "uint8", "bool", "complex64", "float128", "", "F32",
]  # fmt: skip
NAMES = ["", "x", "a/b", "..", "../x", "/etc/passwd", "s3://b/k", "a\x00b", "ü.safetensors"]
FAR = [-1, 0, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]


def reference_state() -> dict[str, Any]:
    """The saved state: several dtypes, pieces over several objects, an empty tensor, values."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(6, 7, generator=g),
            "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "n": torch.arange(9) * -3,
            "e": torch.zeros(0, 4),
        },
        "optim": {
            "mask": torch.rand(11, generator=g) > 0.5,
            "m": torch.randn(13, generator=g).double(),
        },
        "step": 3,
        "cfg": {"lr": 0.25, "name": "tiny", "sizes": [1, [2, 3]], "none": None},
    }


SHARDED_WORLD = 3  # ranks of the sharded (format version 4) checkpoint


def rank_state(rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s share of ``reference_state()`` as a sharded job holds it: the model as one
    FlatParameter (each tensor a ``FlatShard`` with its place in the flat buffer), the mask cut
    by rows, the rest whole on every rank: every tensor is saved under a layout rule."""
    ref = reference_state()
    model = ref["model"]
    chunk = max(-(-sum(t.numel() for t in model.values()) // world), 1)
    start = 0
    for name, t in model.items():
        lo = min(max(rank * chunk - start, 0), t.numel())
        hi = min(max((rank + 1) * chunk - start, 0), t.numel())
        model[name] = storage.FlatShard(t.shape, lo, t.reshape(-1)[lo:hi].clone(), (start, chunk))
        start += t.numel()
    mask = ref["optim"]["mask"]
    rows = -(-mask.numel() // world)
    ref["optim"]["mask"] = storage.FlatShard(
        mask.shape, min(rank * rows, mask.numel()), mask[rank * rows : (rank + 1) * rows].clone()
    )
    return ref


def save_sharded(rank: int, world: int, url: str) -> None:
    """Save ``rank_state`` on every rank of a process group."""
    storage.save(rank_state(rank, world), url, step=STEP, options=OPTIONS)


def save_sharded_on_ranks(url: str, world: int = SHARDED_WORLD, timeout_s: float = 120.0) -> None:
    """``save_sharded`` on ``world`` gloo ranks of ``ftsdp.testing.run_ranks``, forked from its
    fork server (a spawned rank spends seconds importing torch, most of a short fuzz run).
    Raises RuntimeError with the failed ranks' tracebacks, or when one hangs."""
    from ftsdp.testing import run_ranks

    # named, not pickled: run as __main__, this module is not the ranks' __main__
    target = "ftsdp.tools.dev.fuzz_checkpoint:save_sharded"
    run_ranks(target, world, url, timeout=timeout_s, start_method="forkserver")


# The checkpoint fuzzed on a grid (format version 5): the checked-in golden of
# tests/make_storage_golden_v5.py, saved by 4 ranks on a 2 x 2 mesh: boxes of 2 and 3 dims (one
# under a layout rule), row slabs, replicated column blocks and per-rank values. Read from a
# checkout (its tests package), like the rest of tools/dev.
GOLDEN_V5 = Path(__file__).resolve().parents[2] / "tests" / "golden" / "storage_v5"


def golden_v5() -> tuple[dict[str, Any], int]:
    """What a single process loads from ``GOLDEN_V5`` (rank 0's values), and its step."""
    from tests.make_storage_golden_v5 import STEP as GOLDEN_STEP
    from tests.make_storage_golden_v5 import reference

    return {"model": reference(), "trainer": {"step": GOLDEN_STEP, "rank": 0}}, GOLDEN_STEP


def blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    return None


def flat(state: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted names -> leaves (as storage flattens a state)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, name + "."))
        else:
            out[name] = v
    return out


def same(a: Any, b: Any) -> bool:
    """Bitwise for tensors (dtype, shape and bytes), ``==`` and type for values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
            )
        )
    return type(a) is type(b) and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@dataclass
class Case:
    """One mutation: what was done (replayable from the seed and index) and what happened."""

    index: int
    kind: str = ""
    detail: str = ""
    semantic: bool = False  # a resealed edit of a dtype or value: a different valid checkpoint
    outcome: str = ""
    failure: str = ""


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """Give an edited manifest a matching checksum, computed as docs/format.md specifies it
    (independently of the reader's code): CRC-32C (CRC-32 before version 3) of the canonical JSON
    without the field."""
    body = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    old = isinstance(doc.get("version"), int) and doc["version"] < 3
    algorithm, value = ("crc32", zlib.crc32(text)) if old else ("crc32c", crc32c.crc32c(text))
    doc["manifest_checksum"] = {"algorithm": algorithm, "value": value}
    return doc


# -- mutations -----------------------------------------------------------------------------------


class Mutator:
    """Applies one random mutation to the checkpoint at ``root`` (outside: a scratch folder)."""

    def __init__(
        self, rng: random.Random, root: Path, outside: Path, case: Case, step: int = STEP
    ) -> None:
        self.rng, self.root, self.outside, self.case = rng, root, outside, case
        self.step_number = step
        self.step = root / f"step-{step}"

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*") if p.is_file())

    def objects(self) -> list[Path]:
        return sorted(self.step.glob("*.safetensors"))

    def note(self, kind: str, detail: str, semantic: bool = False) -> None:
        self.case.kind, self.case.detail, self.case.semantic = kind, detail, semantic

    def apply(self) -> None:
        kinds = [
            (self.bit_flip, 4), (self.truncate, 2), (self.append, 1), (self.json_edit, 8),
            (self.text_edit, 2), (self.file_edit, 3), (self.link, 3),
        ]  # fmt: skip
        fns, weights = zip(*kinds, strict=True)
        self.rng.choices(fns, weights)[0]()

    # bytes

    def _pick_file(self) -> Path:
        manifest = self.step / "manifest.json"
        return manifest if self.rng.random() < 0.35 else self.rng.choice(self.files())

    def bit_flip(self) -> None:
        path = self._pick_file()
        data = bytearray(path.read_bytes())
        flips = [self.rng.randrange(len(data) * 8) for _ in range(self.rng.choice([1, 1, 2, 3]))]
        for bit in flips:
            data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        self.note("bit flip", f"{path.relative_to(self.root)} bits {flips}")

    def truncate(self) -> None:
        path = self._pick_file()
        size = path.stat().st_size
        keep = self.rng.choice([0, 1, 7, 8, 9, size // 2, size - 1, self.rng.randrange(size)])
        os.truncate(path, keep)
        self.note("truncate", f"{path.relative_to(self.root)} to {keep} of {size} bytes")

    def append(self) -> None:
        path = self._pick_file()
        extra = self.rng.randbytes(self.rng.choice([1, 8, 100]))
        with open(path, "ab") as f:
            f.write(extra)
        self.note("append", f"{len(extra)} bytes to {path.relative_to(self.root)}")

    # manifest JSON

    def _doc(self) -> dict[str, Any]:
        return json.loads((self.step / "manifest.json").read_text())

    def _write(self, doc: dict[str, Any], reseal: bool) -> None:
        if reseal:
            seal(doc)
        (self.step / "manifest.json").write_text(json.dumps(doc))

    def _nodes(self, doc: Any) -> list[tuple[Any, Any, tuple]]:
        """(container, key, path) of every node below the root."""
        out, stack = [], [(doc, ())]
        while stack:
            node, path = stack.pop()
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                out.append((node, k, (*path, k)))
                if isinstance(v, (dict, list)):
                    stack.append((v, (*path, k)))
        return sorted(out, key=lambda n: repr(n[2]))

    def _new_value(self, old: Any) -> Any:
        r = self.rng
        if isinstance(old, bool) or old is None:
            return r.choice([0, 1, "true", [], {}, not old])
        if isinstance(old, int):
            return r.choice([old + 1, old - 1, -old - 1, old * 2, old // 2, float(old),
                             str(old), None, True, [old], *FAR])  # fmt: skip
        if isinstance(old, float):
            return r.choice([old + 1, -old, 0, int(old), str(old), None, float("nan")])
        if isinstance(old, str):
            return r.choice([*NAMES, old + "\n", old.upper(), old * 2, 0, None, [old]])
        return r.choice([None, 0, "", [], {}, [old], {"k": old}])

    def json_edit(self) -> None:
        r = self.rng
        doc = self._doc()
        reseal = r.random() < 0.6
        edit = r.choice(["value", "value", "delete", "rename", "dtype", "object", "swap", "add"])
        parent, key, path = r.choice(self._nodes(doc))
        where = ".".join(map(str, path))
        semantic = _semantic(path)
        if edit == "value":
            new = self._new_value(parent[key])
            parent[key] = new
            detail = f"{where} = {new!r}"
        elif edit == "delete":
            del parent[key]
            detail = f"delete {where}"
        elif edit == "rename" and isinstance(parent, dict):
            new = r.choice([*NAMES, f"{key}\n", f"{key}x", str(key).upper()])
            parent[new] = parent.pop(key)
            detail = f"rename {where} -> {new!r}"
        elif edit == "rename":  # an array element: duplicate it
            parent.insert(key, parent[key])
            detail = f"duplicate {where}"
        elif edit == "dtype":
            name = r.choice(sorted(doc["tensors"]))
            doc["tensors"][name]["dtype"] = new = r.choice(DTYPES)
            detail = f"tensors.{name}.dtype = {new!r}"
            semantic = True
        elif edit == "object":  # point a piece at another object, or rename an object
            names = sorted(doc["objects"])
            old = r.choice(names)
            new = r.choice([*names, *NAMES, old + "\n", old + "/"])
            if r.random() < 0.5:
                doc["objects"][new] = doc["objects"].pop(old)
            for t in doc["tensors"].values():
                for p in t.get("pieces", []):
                    if p["object"] == old:
                        p["object"] = new
            detail = f"object {old!r} -> {new!r}"
            semantic = False
        elif edit == "swap" and "regular" in doc and r.random() < 0.5:
            # two ranks trade their regular objects' count or checksums, or two tensors their rule
            ruled = [t for t in doc["tensors"].values() if "even" in t or "writer" in t]
            if r.random() < 0.5 or len(ruled) < 2:
                ranks = doc["regular"]["ranks"]
                i, j = r.sample(range(len(ranks)), 2)
                f = r.randrange(2)
                ranks[i][f], ranks[j][f] = ranks[j][f], ranks[i][f]
                detail = f"swap regular.ranks[{i}][{f}] and [{j}][{f}]"
            else:
                a, b = r.sample(ruled, 2)
                ka = "even" if "even" in a else "writer"
                kb = "even" if "even" in b else "writer"
                a[kb], b[ka] = b.pop(kb), a.pop(ka)
                detail = f"swap rules {ka} and {kb} of two tensors"
            semantic = False
        elif edit == "swap":  # two pieces trade a field
            pieces = [p for t in doc["tensors"].values() for p in t.get("pieces", [])]
            if len(pieces) < 2:
                return self.json_edit()
            a, b = r.sample(pieces, 2)
            f = r.choice(["object", "offset", "length", "byte_range", "crc32c", "key"])
            a[f], b[f] = b[f], a[f]
            detail = f"swap {f} of pieces {a['key']} and {b['key']}"
            semantic = f == "key"  # load does not read keys: only verify notices
        else:
            new = r.choice(["x", "manifest_checksum", "version", "format"])
            doc[new + r.choice(["", "_"])] = r.choice([1, "x", [], {"a": 1}])
            detail = f"add key {new!r}"
            semantic = False
        self._write(doc, reseal)
        self.note(f"json {edit}{' (resealed)' if reseal else ''}", detail, semantic and reseal)

    def text_edit(self) -> None:
        """Edits a JSON encoder cannot write: deep nesting, huge numbers, bad text."""
        r = self.rng
        path = self.step / "manifest.json"
        text = path.read_text()
        depth = r.choice([65, 200, 999, 5000, 100_000])
        digits = r.choice([4300, 4301, 5000, 100_000])
        anchor = r.choice(['"values":{', '"tensors":{', '"objects":{', '"rank_values":[{'])
        nested_objects = '{"a":' * depth + "1" + "}" * depth
        payload = r.choice([
            f'"deep":{"[" * depth}{"]" * depth},',
            f'"deep":{nested_objects},',
            f'"big":{"9" * digits},',
            f'"big":-{"9" * digits},',
            f'"big":1{"0" * digits}.5e-{digits},',
            '"nan":NaN,', '"inf":-Infinity,', '"big":1e999,', '"bad":"\\ud800",',
        ])  # fmt: skip
        text = text.replace(anchor, anchor + payload, 1)
        path.write_text(text)
        self.note("json text", f"after {anchor!r}: {payload[:40]!r}... ({len(payload)} chars)")

    # files and links

    def file_edit(self) -> None:
        r = self.rng
        objs = self.objects()
        edit = r.choice(["remove", "rename", "swap", "extra", "dir", "step", "torn", "copy"])
        if edit == "remove":
            victim = r.choice([*objs, self.step / "manifest.json", self.root / "latest"])
            victim.unlink()
            detail = str(victim.relative_to(self.root))
        elif edit == "rename":
            victim = r.choice(objs)
            victim.rename(victim.with_name(r.choice(["x.safetensors", victim.name + ".bak"])))
            detail = victim.name
        elif edit == "swap":
            a, b = r.sample(objs, 2)
            tmp = a.with_name("tmp")
            a.rename(tmp)
            b.rename(a)
            tmp.rename(b)
            detail = f"{a.name} <-> {b.name}"
        elif edit == "extra":
            name = r.choice(["extra.safetensors", "manifest.json.tmp", "_done-x.json", ".hidden"])
            (self.step / name).write_bytes(r.randbytes(64))
            detail = name
        elif edit == "dir":  # an object or the manifest replaced by a directory
            victim = r.choice([*objs, self.step / "manifest.json"])
            victim.unlink()
            victim.mkdir()
            (victim / "inner").write_bytes(b"x" * 10)
            detail = str(victim.relative_to(self.root))
        elif edit == "step":  # the step directory renamed
            new = r.choice(["step-2", "step-01", "step-0", "step-x", "step-" + "9" * 240])
            self.step.rename(self.root / new)
            detail = new
        elif edit == "torn":  # an uncommitted step beside it
            torn = self.root / r.choice(["step-0", "step-5"])
            torn.mkdir()
            (torn / objs[0].name).write_bytes(objs[0].read_bytes()[:20])
            detail = torn.name
        else:  # the whole committed step copied under another number
            new = self.root / r.choice(["step-2", "step-0"])
            shutil.copytree(self.step, new)
            detail = f"step-{self.step_number} copied to {new.name}"
        self.note(f"file {edit}", detail)

    def link(self) -> None:
        r = self.rng
        objs = self.objects()
        victim = r.choice([*objs, *objs, self.step / "manifest.json", self.step])
        copy = self.outside / f"copy-{victim.name}"
        if victim.is_dir():
            shutil.copytree(victim, copy)
        else:
            shutil.copy(victim, copy)
        other = self.outside / "other"
        other.write_bytes(r.choice(objs).read_bytes())
        fifo = self.outside / "fifo"
        if not fifo.exists():
            os.mkfifo(fifo)
        target = r.choice([copy, copy, other, Path("/dev/zero"), Path("/dev/null"), fifo,
                           self.outside / "missing", victim, self.outside])  # fmt: skip
        if victim.is_dir():
            shutil.rmtree(victim)
        else:
            victim.unlink()
        victim.symlink_to(target)
        self.note("link", f"{victim.relative_to(self.root)} -> {target}")


def _semantic(path: tuple) -> bool:
    """Whether a resealed edit at ``path`` may leave a valid checkpoint of other content: a
    value, or what a tensor is (its name, shape, dtype or grid order; the whole entry
    deleted)."""
    return path[0] in ("values", "rank_values") or (
        path[0] == "tensors"
        and (len(path) == 2 or path[2:3] in (("shape",), ("dtype",), ("grid",)))
    )


# -- the oracle ----------------------------------------------------------------------------------


CALL_TIMEOUT_S = 0  # set by ``run``: the longest one read may take (0: no limit)


class Hang(Exception):
    """A read ran past its deadline (not an OSError: retries must not swallow it)."""


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Raise ``Hang`` in this (main) thread after ``seconds``: a read that hangs (a FIFO
    opened, an endless device read) is a failure like any other. Uses SIGALRM, as
    pytest-timeout does, so the test suite runs without it."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)  # again every second, should one be eaten
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _try(fn: Any) -> tuple[Any, BaseException | None]:
    try:
        with _deadline(CALL_TIMEOUT_S):
            return fn(), None
    except Exception as e:  # every exception is classified by the caller
        return None, e


def check(url: str, ref: dict[str, Any], case: Case) -> None:
    """Read the mutated checkpoint three ways and judge the results (see the module doc)."""
    expected = flat(ref)
    problems: list[str] = []
    outcomes: list[str] = []

    def judge(what: str, got: dict[str, Any] | None, error: BaseException | None) -> bool:
        if error is not None:
            outcomes.append(type(error).__name__)
            if not isinstance(error, storage.CheckpointError):
                problems.append(
                    f"{what} raised {type(error).__name__}, not a CheckpointError: "
                    + "".join(traceback.format_exception(error)[-6:])
                )
            return False
        wrong = sorted(k for k in set(expected) | set(got) if not same(expected.get(k), got.get(k)))
        if wrong and not case.semantic:
            problems.append(f"{what} returned wrong values for {wrong}")
        outcomes.append("changed" if wrong else "exact")
        return not wrong

    target = blank(ref)
    _, error = _try(lambda: storage.load(target, url))
    loaded = flat(target)
    ok_load = judge("load", None if error else loaded, error)
    if error is not None and not all(same(v, flat(blank(ref))[k]) for k, v in loaded.items()):
        problems.append(f"failed load ({type(error).__name__}) changed its target")

    tensors, error = _try(lambda: storage.load_state_dict(url))
    if tensors is not None:  # load_state_dict returns tensors only: compare those
        tensors = {**{k: v for k, v in expected.items() if not isinstance(v, torch.Tensor)},
                   **tensors}  # fmt: skip
    ok_sd = judge("load_state_dict", tensors, error)

    report, error = _try(lambda: storage.catalog.verify(url))
    if error is not None:
        outcomes.append(f"verify:{type(error).__name__}")
        if not isinstance(error, storage.CheckpointError):
            problems.append(
                f"verify raised {type(error).__name__}, not a CheckpointError: "
                + "".join(traceback.format_exception(error)[-6:])
            )
    else:
        outcomes.append("verify:ok" if report.ok else "verify:problems")
        if report.ok and not (ok_load and ok_sd) and not case.semantic:
            problems.append("verify says OK but the loads did not return the saved values")
    out, err = io.StringIO(), io.StringIO()
    code, error = _try(lambda: ckpt_main(["verify", url, "--json", "-q"], out=out, err=err))
    if error is not None:
        problems.append(f"ftsdp-ckpt verify raised {type(error).__name__}: {error}")
    elif code not in (0, 1, 2) or (report is not None and code != (0 if report.ok else 1)):
        problems.append(f"ftsdp-ckpt verify exited {code} (report: {report}): {err.getvalue()}")
    case.outcome = " ".join(outcomes)
    case.failure = "\n".join(problems)


# -- driver --------------------------------------------------------------------------------------


@dataclass
class Summary:
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[Case]:
        return [c for c in self.cases if c.failure]

    def table(self) -> str:
        by_kind: Counter[tuple[str, str]] = Counter()
        for c in self.cases:
            by_kind[(c.kind, "FAIL" if c.failure else c.outcome)] += 1
        width = max([len(k) for k, _ in by_kind] + [8])
        lines = [f"{'mutation':<{width}}  {'cases':>5}  outcome (load, load_state_dict, verify)"]
        for (kind, outcome), n in sorted(by_kind.items()):
            lines.append(f"{kind:<{width}}  {n:>5}  {outcome}")
        errors: Counter[str] = Counter(
            w for c in self.cases for w in c.outcome.split() if not c.failure
        )
        lines.append(
            f"{len(self.cases)} cases in {self.seconds:.1f} s, {len(self.failures)} failures; "
            + ", ".join(f"{k} {n}" for k, n in sorted(errors.items()))
        )
        return "\n".join(lines)


def describe(c: Case, seed: int) -> str:
    return (
        f"case {c.index} (seed {seed}): {c.kind}: {c.detail}\n  outcome: {c.outcome}\n"
        f"  replay: python -m ftsdp.tools.dev.fuzz_checkpoint --seed {seed} --case {c.index} -v\n"
        + "\n".join(f"  {line}" for line in c.failure.splitlines())
    )


def run(
    cases: int,
    seed: int,
    start: int = 0,
    workdir: str | None = None,
    call_timeout_s: int = 0,
    sharded: bool = False,
    grid: bool = False,
) -> Summary:
    """Cases ``start`` to ``start + cases - 1`` of ``seed``; each is replayable on its own.
    ``call_timeout_s``: fail a read that takes longer (SIGALRM; 0: no limit). ``sharded``: the
    checkpoint is saved by ``SHARDED_WORLD`` ranks under layout rules (format version 4);
    ``grid``: the golden of format version 5 (``GOLDEN_V5``: 4 ranks on a 2 x 2 mesh, tensors
    on grids)."""
    global CALL_TIMEOUT_S
    CALL_TIMEOUT_S = call_timeout_s
    ref, step = golden_v5() if grid else (reference_state(), STEP)
    summary = Summary()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=workdir, prefix="ftsdp-fuzz-") as tmp:
        pristine = Path(tmp) / "pristine"
        if sharded:
            save_sharded_on_ranks(str(pristine))
            assert storage.catalog.read_manifest(str(pristine)).version == 4
        elif grid:
            shutil.copytree(GOLDEN_V5, pristine)
            assert storage.catalog.read_manifest(str(pristine)).version == 5
        else:
            storage.save(ref, str(pristine), step=STEP, options=OPTIONS)
        for i in range(start, start + cases):
            case = Case(i)
            scratch = Path(tmp) / "case"
            root, outside = scratch / "ckpt", scratch / "outside"
            shutil.copytree(pristine, root, symlinks=True)
            outside.mkdir()
            Mutator(random.Random(f"{seed}:{i}"), root, outside, case, step).apply()
            check(str(root), ref, case)
            summary.cases.append(case)
            _remove(scratch)
    summary.seconds = time.perf_counter() - t0
    return summary


def _remove(path: Path) -> None:
    for p in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(FileNotFoundError):
            if p.is_symlink() or not p.is_dir():
                p.unlink()
            else:
                p.rmdir()
    path.rmdir()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=2000, help="how many mutations (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, help="run only this case (replay)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case")
    p.add_argument(
        "--call-timeout", type=int, default=30, help="seconds before a read counts as a hang"
    )
    p.add_argument(
        "--sharded",
        action="store_true",
        help=f"fuzz a checkpoint saved by {SHARDED_WORLD} ranks under layout rules (version 4)",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="fuzz the golden checkpoint of version 5 (4 ranks on a 2 x 2 mesh, tensors on grids)",
    )
    args = p.parse_args(argv)
    start, n = (args.case, 1) if args.case is not None else (0, args.cases)
    summary = run(
        n, args.seed, start, call_timeout_s=args.call_timeout, sharded=args.sharded, grid=args.grid
    )
    for c in summary.cases if args.verbose else summary.failures:
        print(describe(c, args.seed))
    print(summary.table())
    return 1 if summary.failures else 0


if __name__ == "__main__":
    sys.exit(main())
