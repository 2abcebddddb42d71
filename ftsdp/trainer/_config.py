"""The training entry's configuration: one keyword-only dataclass, and its command line.

Every field of :class:`TrainConfig` is a CLI flag (``n_layer`` -> ``--n-layer``) whose type,
default and help come from the field itself, so the two never drift. The defaults are the main
job: a ~0.8M-parameter GPT on the synthetic Markov language that finishes in about a minute on
two CPU cores with two ranks, the loss falling from ~ln(256) = 5.5 towards the chain's entropy
rate (~1.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

from ftsdp.elastic import BatchGeometry
from ftsdp.trainer.model import GPTConfig

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
DEVICES = ("auto", "cpu", "cuda")


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # model
    vocab_size: int = _opt(256, "vocabulary size of the model and the synthetic language")
    block_size: int = _opt(64, "tokens per sample (context length)")
    n_layer: int = _opt(4, "transformer blocks (each one FSDP unit)")
    n_head: int = _opt(4, "attention heads per block")
    n_embd: int = _opt(128, "embedding width (divisible by n_head)")
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

        for name in ("global_batch", "micro_batch", "steps", "log_every", "keep_last"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        for name in (
            "checkpoint_every",
            "checkpoint_every_s",
            "heartbeat_timeout_s",
            "progress_timeout_s",
        ):
            need(getattr(self, name) >= 0, name, "must be >= 0 (0 disables it)")
        for name in ("pg_timeout_s", "preempt_grace_s"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.seed >= 0, "seed", "must be >= 0")
        need(self.lr > 0, "lr", "must be > 0")
        need(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr}]")
        # warmup > steps is allowed (a short run of a default config): lr then only ramps up.
        need(self.warmup >= 0, "warmup", "must be >= 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
        need(
            self.global_batch % self.micro_batch == 0,
            "global_batch",
            f"must be a multiple of micro_batch={self.micro_batch}",
        )
        need(
            self.sharding_strategy in SHARDING_STRATEGIES,
            "sharding_strategy",
            f"must be one of {SHARDING_STRATEGIES}",
        )
        need(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        self.model_config()  # GPTConfig validates the model shape

    def model_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )

    def geometry(self, world_size: int) -> BatchGeometry:
        """The batch geometry at ``world_size``; a ValueError lists the world sizes that work."""
        return BatchGeometry(
            global_batch=self.global_batch, micro_batch=self.micro_batch, world_size=world_size
        )

    def accum_steps(self, world_size: int) -> int:
        """Micro-batches per rank per step: ``global_batch / (micro_batch * world_size)``."""
        return self.geometry(world_size).accum_steps


def _flag_type(hint: object) -> type:
    """``int``/``float``/``str``/``bool``, unwrapping ``X | None``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    assert hint in (int, float, str, bool), f"unsupported TrainConfig field type {hint!r}"
    return hint  # type: ignore[return-value]


def build_parser(cls: type = TrainConfig) -> argparse.ArgumentParser:
    """An argparse parser with one ``--flag`` per field of the dataclass ``cls``."""
    parser = argparse.ArgumentParser(
        prog="ftsdp-train",
        description="Train a small GPT with the ftsdp FSDP engine "
        "(torchrun --standalone --nproc-per-node=2 -m ftsdp.train).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        kw = {"default": f.default, "help": f.metadata.get("help", ""), "dest": f.name}
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            parser.add_argument(flag, type=kind, choices=f.metadata.get("choices"), **kw)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """CLI -> validated :class:`TrainConfig`; a bad value exits with argparse's usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
