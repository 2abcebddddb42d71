"""The ``ftsdp-ckpt`` command line, and its terminal output (safe text, sizes, a progress line on
stderr when it is a terminal). Neither imports torch nor ``ftsdp.storage``: the storage
constants the help shows are copied here (tests/unit/tools/ckpt/test_cli.py checks they agree)
and ``--dtype`` becomes a ``torch.dtype`` once the command line is known to be good."""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
import time
from typing import Any, NoReturn, TextIO

import ftsdp

PROG = "ftsdp-ckpt"
DEFAULT_MAX_MEMORY = 256 * 1024**2  # storage.io.DEFAULT_MAX_MEMORY
FORMATS = ("ftsdp", "hf", "torch", "dcp")  # storage.conversion.FORMATS
GRACE_S = 3600.0  # storage.catalog.GRACE_S
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.I)
_DTYPES = {  # spelling -> the torch attribute
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64",
}  # fmt: skip


class UsageError(ValueError):
    """A bad command line (exit code 2, one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        raise UsageError(f"{message} (see {self.prog} --help)")


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864, ``"5GB"`` -> 5000000000, ``"1024"`` -> 1024."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 1048576, 64MiB, 5GB)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = "kmgt".index(unit) + 1 if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


def parse_dtype(text: str) -> str:
    """``"bf16"`` -> ``"bfloat16"`` (the ``torch`` attribute; :func:`parse` makes it a dtype)."""
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose one of {', '.join(sorted(_DTYPES))}"
        ) from None


def parse_rename(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise argparse.ArgumentTypeError(
            f"rename {text!r} must be OLD=NEW with a non-empty OLD prefix"
        )
    return old, new


def parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"storage option {text!r} must be KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"2x2"`` -> ``(2, 2)``: the size of each mesh dim, each >= 1."""
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"mesh {text!r} must be mesh dim sizes >= 1 joined by x (examples: 4, 2x2, 2x2x2)"
        )
    return tuple(int(p) for p in parts)


_PLACEMENTS = re.compile(r"(S\d+|R)(,(S\d+|R))*")


def parse_placement(text: str) -> tuple[str, str]:
    """``"model.*.bias=S0,R"`` -> ``("model.*.bias", "S0,R")``."""
    pattern, sep, spec = text.rpartition("=")
    spec = spec.replace(" ", "")
    if not sep or not pattern or not _PLACEMENTS.fullmatch(spec):
        raise argparse.ArgumentTypeError(
            f"placement {text!r} must be PATTERN=SPEC, SPEC one of S<dim> (Shard) or R "
            "(Replicate) per mesh dim, comma-separated (example: 'model.*.bias=S0,R')"
        )
    return pattern, spec


def parse_step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"step {text!r} must be a non-negative integer")
    return int(text)


def parse_seconds(text: str) -> float:
    """A finite number of seconds >= 0 (``nan`` or a negative one would turn a wait off)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of seconds >= 0")
    return value


def parse_positive(text: str) -> int:
    """A count of at least 1 (``gc --keep-last 0`` would delete every committed step)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return int(text)


_POSITIONALS = {
    "url": "a checkpoint: an ftsdp root or step directory (local path or fsspec URL), a Hugging "
    "Face folder or .safetensors file, a torch.save file or a DCP directory",
    "src": "the checkpoint to read (any format, detected; see url in inspect --help)",
    "dst": "where to write it (a new location, or --overwrite)",
    "diff url": "an ftsdp checkpoint root (local path or fsspec URL)",
    "gc url": "an ftsdp checkpoint root (local path or fsspec URL)",
}


def _mesh_options(p: argparse.ArgumentParser, layout: Any) -> None:
    """``--mesh`` (in the group ``layout``, beside ``--world-size``) and ``--placement``."""
    layout.add_argument(
        "--mesh", type=parse_mesh, metavar="AxB",
        help="ftsdp output: lay the step out as the ranks of this device mesh (e.g. 2x2 for dp "
        "x tp; rank r at the r-th coordinate, row-major) would save DTensors of each tensor's "
        "placements: the boxes of a grid (format version 5). Default placements: mesh dim m "
        "shards tensor dim m (torch's chunking, uneven allowed) while the tensor has a dim m, "
        "else replicates (2-D weights S0,S1; 1-D S0,R; scalars R,R)",
    )  # fmt: skip
    p.add_argument(
        "--placement", type=parse_placement, action="append", default=[],
        metavar="PATTERN=SPEC",
        help="with --mesh: the placements of the tensors whose output name matches the fnmatch "
        "PATTERN, one per mesh dim, comma-separated: S<d> shards tensor dim d, R replicates "
        "(e.g. 'model.*.wo.weight=S0,S1', '*.bias=R,S0'); first match wins; repeatable",
    )  # fmt: skip


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The parser of every subcommand, built once per process: parsing leaves it as it was."""
    common = _Parser(add_help=False)
    common.add_argument(
        "--max-memory", type=parse_size, default=DEFAULT_MAX_MEMORY, metavar="SIZE",
        help="memory budget for data in flight (default 256MiB; e.g. 64MiB, 2GB)",
    )  # fmt: skip
    common.add_argument(
        "-o", "--storage-option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
        help="fsspec option for every URL (e.g. endpoint_url=http://...); repeatable",
    )  # fmt: skip
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    common.add_argument(
        "--debug", action="store_true", help="print the traceback of an internal error (exit 3)"
    )

    # every command that reads a checkpoint's data (all but gc)
    reads = _Parser(add_help=False, parents=[common])
    reads.add_argument(
        "--trust-pickle", action="store_true",
        help="unpickle a DCP source's .metadata fully, which can run code from it: only for "
        "checkpoints you trust (default: only DCP's metadata classes are admitted)",
    )  # fmt: skip
    writes = _Parser(add_help=False, parents=[reads])  # convert and reshard
    writes.add_argument("--step", type=parse_step, help="ftsdp source step (default: the newest)")
    writes.add_argument(
        "--dst-step", type=parse_step, help="ftsdp output step (default: the source's, else 0)"
    )
    writes.add_argument(
        "--dtype", type=parse_dtype, help="cast floating tensors (bf16, fp16, fp32, fp64)"
    )
    writes.add_argument(
        "--model-only", action="store_true", help="drop optimizer state and non-tensor values"
    )
    writes.add_argument(
        "--rename", type=parse_rename, action="append", default=[], metavar="OLD=NEW",
        help="replace the name prefix OLD by NEW (first match wins); repeatable",
    )  # fmt: skip
    writes.add_argument(
        "--overwrite", action="store_true", help="replace a checkpoint already at DST"
    )

    parser = _Parser(
        prog=PROG, description="Inspect, verify, convert, reshard, diff and clean checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {ftsdp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, help: str, *positionals: str, parent: Any = reads) -> Any:
        p = sub.add_parser(name, parents=[parent], help=help)
        for positional in positionals:
            what = _POSITIONALS.get(f"{name} {positional}", _POSITIONALS[positional])
            p.add_argument(positional, help=what)
        return p

    p = command("inspect", "steps, tensors, sizes and state keys", "url")
    p.add_argument(
        "--step",
        type=parse_step,
        help="ftsdp: the committed step to describe (default: the newest)",
    )
    p.add_argument(
        "--tensors", action="store_true",
        help="also list every tensor (name, shape, dtype, bytes) after the summary",
    )  # fmt: skip
    p.add_argument(
        "--json", action="store_true", help="machine-readable output (every tensor included)"
    )

    p = command("verify", "read every byte and check checksums and sizes", "url")
    p.add_argument("--step", type=parse_step, help="only this step (default: every committed step)")
    p.add_argument("--json", action="store_true")

    p = command("convert", "convert between ftsdp, hf, torch and dcp", "src", "dst", parent=writes)
    formats = ", ".join(FORMATS)
    p.add_argument("--to", required=True, metavar="FORMAT", help=f"one of {formats}")
    p.add_argument(
        "--from", dest="src_format", metavar="FORMAT", help="source format (default: detected)"
    )
    layout = p.add_mutually_exclusive_group()
    layout.add_argument(
        "--world-size", type=int, help="ftsdp output: lay the step out for this many ranks"
    )
    _mesh_options(p, layout)
    p.add_argument(
        "--max-shard-size", type=parse_size, metavar="SIZE",
        help="hf output: split into files of at most SIZE",
    )  # fmt: skip
    p.add_argument(
        "--include-optimizer", action="store_true",
        help="hf output: also write the optimizer state (under its saved names) and the "
        "non-tensor values (default: model weights only)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", metavar="DIR",
        help="hf output: copy the tokenizer files from DIR (default: from the recorded "
        "tokenizer_dir only when it lies inside the checkpoint)",
    )  # fmt: skip
    p.add_argument(
        "--keep-names", action="store_true",
        help="hf output: keep every name as saved (no 'model.' strip, no config.json nor "
        "tokenizer files): a dump that converts back as it was",
    )  # fmt: skip

    p = command(
        "reshard", "rewrite a checkpoint as ftsdp for another world size or device mesh", "src",
        "dst", parent=writes,
    )  # fmt: skip
    layout = p.add_mutually_exclusive_group(required=True)
    layout.add_argument(
        "--world-size", type=int, metavar="M", help="M ranks, each tensor cut in M flat ranges"
    )
    _mesh_options(p, layout)

    p = command("diff", "which tensors changed between two steps", "url")
    p.add_argument("step_a", type=parse_step)
    p.add_argument("step_b", type=parse_step)
    p.add_argument("--json", action="store_true")

    p = command("gc", "remove torn attempts and steps past retention", "url", parent=common)
    p.add_argument(
        "--keep-last", type=parse_positive, metavar="K",
        help="keep the newest K >= 1 committed steps (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--keep-every", type=parse_positive, metavar="E",
        help="also keep every step divisible by E >= 1",
    )  # fmt: skip
    p.add_argument(
        "--grace-s", type=parse_seconds, default=GRACE_S, metavar="S",
        help="leave uncommitted files written less than S seconds ago: a save may be writing "
        f"them (default: {GRACE_S:g}; 0 removes every torn attempt now)",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; ``UsageError`` (one line) for anything wrong with it."""
    args = _parser().parse_args(argv)
    args.storage_options = dict(args.storage_option) or None
    if getattr(args, "dtype", None) is not None:
        import torch  # here, not at the top: see the module docstring

        args.dtype = getattr(torch, args.dtype)
    # the number of placements per mesh dim is checked where they are parsed (storage)
    if args.command in ("convert", "reshard") and args.placement and args.mesh is None:
        raise UsageError("--placement applies with --mesh only")
    if args.command != "convert":
        return args
    if args.mesh is not None and args.to != "ftsdp":
        raise UsageError(f"--mesh applies to --to ftsdp only, not {args.to}")
    # --include-optimizer, --keep-names and --tokenizer shape the hf export only
    for flag, on in (
        ("--include-optimizer", args.include_optimizer),
        ("--keep-names", args.keep_names),
        ("--tokenizer", args.tokenizer),
    ):
        if on and args.to != "hf":
            raise UsageError(
                f"{flag} applies to --to hf only (the {args.to} format keeps every tensor and "
                "value unless --model-only)"
            )
    if args.tokenizer and args.keep_names:
        raise UsageError("--tokenizer contradicts --keep-names (which copies no files); pass one")
    if args.include_optimizer and args.model_only:
        raise UsageError("--include-optimizer contradicts --model-only; pass one of them")
    return args


def printable(text: object) -> str:
    """``str(text)`` with each non-printable character escaped as Python writes it (``\\x1b``,
    ``\\u202e``): names from a checkpoint must not hide or forge a line (not for JSON output)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in str(text))


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class ProgressBar:
    """Callable ``(done, total)`` that redraws one line at most 10 times a second."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label, self.stream = label, stream
        self.start = time.monotonic()
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < 0.1 and done < total:
            return
        self._last = now
        elapsed = max(now - self.start, 1e-6)
        rate = done / elapsed
        frac = done / total if total else 1.0
        eta = int((total - done) / rate) if rate > 0 else 0
        bar = "#" * int(frac * 24) + "-" * (24 - int(frac * 24))
        line = (
            f"\r{self.label} [{bar}] {frac:4.0%} {human_bytes(done)}/{human_bytes(total)} "
            f"{human_bytes(rate)}/s ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
        )
        self.stream.write(line + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line (only if something was drawn)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def progress_for(label: str, enabled: bool) -> ProgressBar | None:
    """A bar on stderr if enabled and stderr is a terminal, else None (silent in pipes)."""
    return ProgressBar(label, sys.stderr) if enabled and sys.stderr.isatty() else None
