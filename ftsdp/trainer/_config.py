"""The training entry's configuration: each :class:`TrainConfig` field is a flag (``--n-layer``,
also ``--n_layer``) with the field's type, default and help; ``--config FILE.toml`` sets flags."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import types
import typing
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ftsdp

if TYPE_CHECKING:  # both import torch, which --help does without (ftsdp/train.py)
    from ftsdp.elastic import BatchGeometry
    from ftsdp.examples.gpt import GPTConfig

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
DEVICES = ("auto", "cpu", "cuda")
DATA_DTYPES = ("uint16", "uint32")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MIXED_PRECISION = ("none", "bf16", "fp16")
GPT_SPEC = "gpt"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")  # a URL's start, also inside hf:https://...


def redact_url(value: str) -> str:
    """``value`` (unchanged when it has none) without the userinfo (``user:password@``), query and
    fragment of the URL in it: what may be shown of a URL whose credentials travel in it."""
    m = _URL.search(value)
    if m is None:
        return value
    try:
        scheme, netloc, path, query, fragment = urllib.parse.urlsplit(value[m.start() :])
    except ValueError:  # e.g. an unclosed [ in the host: nothing of it is shown
        return value[: m.end()] + "<not a URL>"
    if "@" not in netloc and not query and not fragment:
        return value
    host = netloc.rpartition("@")[2]
    return value[: m.start()] + urllib.parse.urlunsplit((scheme, host, path, "", ""))


MAX_SECONDS = 1e9  # any duration flag (timedelta and torch's timeouts overflow far above)


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model``: ``kind`` gpt, hf (``arg``: DIR) or py (``arg``: MODULE:FUNCTION)."""

    kind: str
    arg: str = ""

    @classmethod
    def parse(cls, spec: str) -> ModelSpec:
        """ValueError (one line, with the accepted forms) for anything else."""
        if spec == GPT_SPEC:
            return cls("gpt")
        kind, _, rest = spec.partition(":")
        if kind == "hf" and rest:
            return cls("hf", rest)
        if kind == "py":
            parts = rest.split(":")
            if (
                len(parts) == 2
                and all(_IDENT.fullmatch(p) for p in parts[0].split("."))
                and _IDENT.fullmatch(parts[1])
            ):
                return cls("py", rest)
        raise ValueError(
            f"model={spec!r} must be gpt, hf:DIR (a local Hugging Face config directory) or "
            "py:MODULE:FUNCTION (a factory returning an nn.Module)"
        )


def _opt(default: typing.Any, help: str, **kw: typing.Any) -> typing.Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # what is trained, on what (docs/training.md)
    model: str = _opt(
        "gpt",
        "gpt (the built-in GPT, shaped by the flags below), hf:DIR (a Hugging Face causal LM "
        "from the config.json in a local directory) or py:MODULE:FUNCTION (FUNCTION(cfg) returns "
        "an nn.Module, or (module, auto_wrap_policy))",
    )
    data: str = _opt(
        "markov",
        "markov (the built-in synthetic language), FILE.bin (a flat token file, memory-mapped) "
        "or a UTF-8 text file (its bytes are the tokens)",
    )
    data_dtype: str = _opt("uint16", "token dtype of a .bin data file", choices=DATA_DTYPES)
    init_from: str | None = _opt(
        None,
        "start from the weights of this checkpoint (a Hugging Face directory, a torch.save file, "
        "DCP or an ftsdp root) before step 0; a resume from --checkpoint-url wins over it",
    )
    mixed_precision: str = _opt(
        "none",
        "compute and all-gather in bf16 or fp16 (fp32 master weights, fp32 gradient reduction; "
        "fp16 scales the loss with ftsdp.ShardedGradScaler)",
        choices=MIXED_PRECISION,
    )
    # the built-in GPT's shape (vocab_size also sizes the synthetic language)
    vocab_size: int = _opt(256, "vocabulary size of the GPT and the synthetic language")
    block_size: int = _opt(64, "tokens per sample (context length), for every model")
    n_layer: int = _opt(4, "transformer blocks of the GPT (each one FSDP unit)")
    n_head: int = _opt(4, "attention heads per block of the GPT")
    n_embd: int = _opt(128, "embedding width of the GPT (divisible by n_head)")
    # batch geometry
    global_batch: int = _opt(32, "samples per optimizer step, over all ranks")
    micro_batch: int = _opt(8, "samples per forward/backward on one rank")
    # optimisation
    steps: int = _opt(150, "optimizer steps")
    lr: float = _opt(3e-3, "peak learning rate (AdamW)")
    warmup: int = _opt(15, "linear warm-up steps")
    min_lr: float = _opt(3e-4, "learning rate at the end of the cosine decay")
    weight_decay: float = _opt(0.1, "AdamW weight decay (not on biases and LayerNorm weights)")
    grad_clip: float = _opt(1.0, "max global gradient norm; 0 disables clipping")
    seed: int = _opt(0, "seed of the model init and the synthetic language")
    # runtime
    sharding_strategy: str = _opt(
        "FULL_SHARD", "FSDP sharding strategy", choices=SHARDING_STRATEGIES
    )
    device: str = _opt("auto", "auto: cuda if available, else cpu", choices=DEVICES)
    log_every: int = _opt(10, "print one log line every N steps (and at the last step)")
    metrics: str | None = _opt(None, "append one JSON record per log line to this path (rank 0)")
    tensorboard: str | None = _opt(
        None,
        "also write the metrics as TensorBoard scalars into this directory (rank 0; needs "
        "pip install 'ftsdp[tensorboard]')",
    )
    log_level: str = _opt(
        "INFO",
        "INFO: rank 0's progress lines on stdout, warnings and errors of every rank on stderr; "
        "WARNING: only those; DEBUG: everything, from every rank",
        choices=LOG_LEVELS,
        normalise=str.upper,  # --log-level debug works too
    )
    ledger: str | None = _opt(
        None, "append the dataset indices of every global step to this JSONL path (rank 0)"
    )
    shuffle: bool = _opt(True, "shuffle the global sample order per epoch (seeded)")
    deterministic: bool = _opt(
        False,
        "bitwise-reproducible training at any world size: fixed micro-batch decomposition, "
        "gradients summed in a fixed order, one torch thread per rank",
    )
    # checkpoints (storage options for remote URLs: FTSDP_STORAGE_OPTIONS, a JSON object)
    checkpoint_url: str | None = _opt(
        None, "checkpoint root (a directory or fsspec URL); resume from its newest step"
    )
    checkpoint_every: int = _opt(50, "save every N steps (0: only at the end and on preemption)")
    checkpoint_every_s: float = _opt(0.0, "also save every T seconds (0: off)")
    keep_last: int = _opt(3, "keep the newest N committed checkpoints")
    async_save: bool = _opt(True, "upload checkpoints in the background")
    defer_copy: bool = _opt(
        True, "async saves copy the state in the background too (the optimizer step waits)"
    )
    persister: bool = _opt(
        False,
        "saves copy the state once into shared memory and a persister process writes and "
        "commits it (ranks on one machine)",
    )
    memory_every: int = _opt(
        0,
        "also save every N steps to host shared memory, for restarts on this machine; on several "
        "machines each also keeps a replica of another's, for a lost machine (0: off)",
    )
    memory_url: str | None = _opt(
        None, "root of those saves (default: /dev/shm/ftsdp-<uid>-<hash of the checkpoint root>)"
    )
    # elastic runtime
    pg_timeout_s: float = _opt(300.0, "timeout of every collective (seconds)")
    heartbeat_timeout_s: float = _opt(
        30.0, "a rank without heartbeat this long is stalled: the job restarts (0: no watchdog)"
    )
    progress_timeout_s: float = _opt(
        0.0, "no rank finishing a step this long (yet all alive) is a stall (0: off)"
    )
    preempt_grace_s: float = _opt(
        20.0, "after SIGTERM/SIGUSR1: save and exit within this many seconds"
    )

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"TrainConfig: {name}={getattr(self, name)!r} {rule}")

        # first, as the other checks show the values: a URL's credentials never reach the saved
        # config, the metrics or a log line (docs/cli.md, "On a shared machine")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and redact_url(value) != value:
                raise ValueError(
                    f"TrainConfig: {f.name}={redact_url(value)!r} (shown without them) must not "
                    "carry credentials, a query or a fragment in its URL: the config is saved in "
                    "every checkpoint, the metrics and the logs. Pass credentials through "
                    "FTSDP_STORAGE_OPTIONS (a JSON object of fsspec storage options, e.g. "
                    '{"key": ..., "secret": ...}) or the storage\'s own environment variables '
                    "(AWS_ACCESS_KEY_ID, ...)"
                )
        for f in dataclasses.fields(self):  # inf passes every >= check, then breaks a timedelta
            value = getattr(self, f.name)
            if isinstance(value, float):
                need(math.isfinite(value), f.name, "must be a finite number")
            if f.name.endswith("_s"):  # a duration: torch's and Python's clocks hold ~30 years
                need(value <= MAX_SECONDS, f.name, f"must be at most {MAX_SECONDS:g} seconds")
        for name in ("global_batch", "micro_batch", "steps", "log_every", "keep_last"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        periods = ("checkpoint_every", "memory_every", "checkpoint_every_s")
        for name in (*periods, "heartbeat_timeout_s", "progress_timeout_s"):
            need(getattr(self, name) >= 0, name, "must be >= 0 (0 disables it)")
        for name in ("pg_timeout_s", "preempt_grace_s", "lr"):
            need(getattr(self, name) > 0, name, "must be > 0")
        # warmup > steps is allowed (a short run of a default config): lr then only ramps up.
        for name in ("seed", "warmup", "weight_decay"):
            need(getattr(self, name) >= 0, name, "must be >= 0")
        need(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr}]")
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
        need(
            self.global_batch % self.micro_batch == 0,
            "global_batch",
            f"must be a multiple of micro_batch={self.micro_batch}",
        )
        for f in dataclasses.fields(self):  # --log-level is normalised, then checked by logging
            choices = f.metadata.get("choices")
            if choices and "normalise" not in f.metadata:
                need(getattr(self, f.name) in choices, f.name, f"must be one of {choices}")
        need(bool(self.data), "data", "must be markov or a file")
        need(self.init_from != "", "init_from", "must be a checkpoint URL (or not given)")
        need(  # flags that would do nothing: refused, not ignored
            not self.memory_every or bool(self.checkpoint_url),
            "memory_every",
            "needs --checkpoint-url (the memory tier keeps the steps between its checkpoints)",
        )
        need(
            self.memory_url is None or self.memory_every > 0, "memory_url", "needs --memory-every N"
        )
        need(self.tensorboard != "", "tensorboard", "must be a directory (or not given)")
        need(
            not _same_place(self.memory_url, self.checkpoint_url),
            "memory_url",
            "must differ from --checkpoint-url (the memory tier is a root of its own)",
        )
        # local paths that cannot be what they are for: refused now, not at the first save
        for name, kind in (
            ("checkpoint_url", "dir"),
            ("memory_url", "dir"),
            ("metrics", "file"),
            ("ledger", "file"),
            ("tensorboard", "dir"),
        ):
            problem = _unusable_local_path(getattr(self, name), kind)
            need(problem is None, name, problem or "")
        try:
            ModelSpec.parse(self.model)
        except ValueError as e:  # names the accepted forms
            raise ValueError(f"TrainConfig: {e}") from None
        if self.model == "gpt":
            self.model_config()  # GPTConfig validates the model shape
        else:
            need(self.block_size >= 1, "block_size", "must be >= 1")
        need(self.vocab_size >= 2, "vocab_size", "must be >= 2")

    def model_config(self) -> GPTConfig:
        from ftsdp.examples.gpt import GPTConfig

        return GPTConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )

    def geometry(self, world_size: int) -> BatchGeometry:
        """The batch geometry at ``world_size`` (any world size works: ftsdp.elastic)."""
        from ftsdp.elastic import BatchGeometry

        return BatchGeometry(
            global_batch=self.global_batch, micro_batch=self.micro_batch, world_size=world_size
        )


def _flag_type(hint: object) -> type:
    """``int``/``float``/``str``/``bool``, unwrapping ``X | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    assert hint in (int, float, str, bool), f"unsupported TrainConfig field type {hint!r}"
    return hint


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, as ftsdp-ckpt: not usage first
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""  # a help that names its own default keeps it, once
        return help if "(default:" in help else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The parser: one ``--flag`` per :class:`TrainConfig` field, and ``--config FILE.toml``."""
    parser = _Parser(
        prog="ftsdp-train",
        description="Train a model with the ftsdp FSDP engine, elastically "
        "(torchrun --standalone --nproc-per-node=2 -m ftsdp.train). Every --flag-name is also "
        "accepted as --flag_name.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="read flags from this TOML file (keys: flag names, with dashes or underscores); "
        "flags on the command line override it",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {ftsdp.__version__}")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kind = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        kw = {"default": f.default, "help": f.metadata.get("help", ""), "dest": f.name}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            kind = f.metadata.get("normalise", kind)
            parser.add_argument(flag, type=kind, choices=f.metadata.get("choices"), **kw)
    return parser


def normalise_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``--flag_name`` (and ``--flag_name=value``) -> ``--flag-name`` for the parser's flags;
    anything else, and everything after ``--``, unchanged."""
    known = parser._option_string_actions
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            out.extend(argv[i:])
            break
        name, eq, value = arg.partition("=")
        if name.startswith("--") and "_" in name:
            dashed = "--" + name[2:].replace("_", "-")
            if dashed in known:
                arg = dashed + eq + value
        out.append(arg)
    return out


def _read_toml(path: str) -> dict[str, typing.Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(
                f"--config {path}: reading TOML needs Python 3.11+ or `pip install tomli`"
            ) from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}") from None


def config_defaults(path: str) -> dict[str, typing.Any]:
    """``{field name: value}`` set by the TOML file at ``path`` (keys: flag names, ``-`` or
    ``_``); ValueError naming unknown keys and values of the wrong type."""
    table = _read_toml(path)
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = [k for k in table if k.replace("-", "_") not in fields]
    if unknown:
        raise ValueError(
            f"--config {path}: unknown key(s) {unknown}; keys are the flag names "
            "(ftsdp-train --help), e.g. global-batch = 32"
        )
    values: dict[str, typing.Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in values:
            raise ValueError(f"--config {path}: {name} is set twice (as - and _ spellings)")
        kind = _flag_type(hints[name])
        # a bool is an int to isinstance: only a bool field takes one; a float field takes an int
        allowed = (int, float) if kind is float else kind
        if not isinstance(value, allowed) or isinstance(value, bool) != (kind is bool):
            raise ValueError(
                f"--config {path}: {key} = {value!r} must be a TOML {kind.__name__}"
                + (" (a quoted string)" if kind is str else "")
            )
        value = fields[name].metadata.get("normalise", lambda v: v)(value)
        values[name] = float(value) if kind is float else value
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"--config {path}: {key} = {value!r} must be one of {choices}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """CLI and ``--config`` -> a validated :class:`TrainConfig`; a bad value exits 2."""
    parser = build_parser()
    argv = normalise_flags(sys.argv[1:] if argv is None else list(argv), parser)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    if path:
        try:
            parser.set_defaults(**config_defaults(path))
        except ValueError as e:
            parser.error(str(e))
    values = vars(parser.parse_args(argv))
    values.pop("config")
    try:
        return TrainConfig(**values)
    except ValueError as e:
        parser.error(str(e))


def _local(url: str | None) -> str | None:
    """The local path of ``url`` (a plain path or ``file://``), else None (another filesystem)."""
    if url is None:
        return None
    if url.startswith("file://"):
        return url[len("file://") :]
    return None if "://" in url else url


def _same_place(a: str | None, b: str | None) -> bool:
    """Whether ``a`` and ``b`` name one place (local paths resolved; other URLs as written)."""
    if a is None or b is None:
        return False
    pa, pb = _local(a), _local(b)
    if pa is None or pb is None:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(os.path.expanduser(pa)) == os.path.realpath(os.path.expanduser(pb))


def _unusable_local_path(url: str | None, kind: str) -> str | None:
    """Why local ``url`` cannot be a ``kind`` ("dir" or "file") this job writes, or None."""
    path = _local(url)
    if not path:
        return None
    path = os.path.expanduser(path)
    if kind == "dir" and os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    if kind == "file" and os.path.isdir(path):
        return "is a directory, not a file"
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        return f"cannot be made: {parent} is a file"
    return None
