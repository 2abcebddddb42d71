"""What the main job trains on (``--data``) and its record (docs/training.md, "--data")."""

from __future__ import annotations

import codecs
import hashlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ftsdp.examples.data import MarkovDataset, TokenDataset
from ftsdp.trainer._config import TrainConfig
from ftsdp.trainer._errors import JobError

MARKOV = "markov"
HEAD_BYTES = 1 << 20  # the hash in the record covers this much of the file's head
TOKEN_FILE_SUFFIX = ".bin"


@dataclass(frozen=True)
class Data:
    """The dataset, what the checkpoint records about it, and its largest token id."""

    dataset: MarkovDataset | TokenDataset
    record: dict[str, Any]  # trainer.data
    max_token: int
    description: str  # for the start line


def markov_record() -> dict[str, Any]:
    """``trainer.data`` of the built-in language (also assumed for checkpoints that predate it)."""
    return {"spec": MARKOV, "dtype": None, "head_sha256": None, "tokens": None}


def head_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file's first :data:`HEAD_BYTES` (all of it when shorter)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()


def open_data(cfg: TrainConfig) -> Data:
    """``cfg.data`` opened; :class:`JobError` for a missing or unusable file."""
    if cfg.data == MARKOV:
        markov = MarkovDataset(cfg.vocab_size, cfg.block_size, seed=cfg.seed)
        return Data(
            markov,
            markov_record(),
            cfg.vocab_size - 1,
            f"synthetic Markov language, loss at init ~ ln(V) = {markov.uniform_loss:.3f}, "
            f"achievable ~ {markov.entropy_rate:.3f} (chain entropy rate)",
        )
    path = os.path.expanduser(cfg.data)
    if not os.path.isfile(path):
        raise JobError(
            f"--data {cfg.data}: no such file; pass markov, a token file FILE.bin or a UTF-8 "
            "text file"
        )
    size = os.path.getsize(path)
    if path.endswith(TOKEN_FILE_SUFFIX):
        dtype = np.dtype(cfg.data_dtype)
        if size % dtype.itemsize:
            raise JobError(
                f"--data {cfg.data}: {size} bytes is not a whole number of {dtype.name} tokens; "
                "is --data-dtype right (uint16 or uint32)?"
            )
        kind = f"token file ({dtype.name})"
    else:
        dtype = np.dtype(np.uint8)
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
        try:  # incremental: a character cut at the end of the head is not an error
            codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) == size)
        except UnicodeDecodeError as e:
            raise JobError(
                f"--data {cfg.data}: not UTF-8 text ({e.reason} at byte {e.start}); a token "
                f"file must end in {TOKEN_FILE_SUFFIX} (with --data-dtype uint16 or uint32)"
            ) from None
        kind = "text file (bytes as tokens)"
    if size < dtype.itemsize * (cfg.block_size + 1):
        raise JobError(
            f"--data {cfg.data}: {size // dtype.itemsize} tokens are fewer than one sample of "
            f"block_size + 1 = {cfg.block_size + 1}; use more data or a smaller --block-size"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    ds = TokenDataset(tokens, cfg.block_size, seed=cfg.seed)
    record = {
        "spec": cfg.data,
        "dtype": dtype.name,
        "head_sha256": head_sha256(path),
        "tokens": len(tokens),
    }
    return Data(
        ds,
        record,
        ds.max_token(),
        f"{kind} {cfg.data}: {len(tokens)} tokens, {len(ds)} samples per epoch, windows of "
        f"{cfg.block_size + 1} at seeded random offsets",
    )


def data_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why a checkpoint's ``trainer.data`` is other data than ``current`` (None: the same data).
    A file counts as the same data by its dtype, length and head, whatever its path."""
    if (saved.get("spec") == MARKOV) != (current.get("spec") == MARKOV):
        return f"data {saved.get('spec')!r} -> {current.get('spec')!r}"

    def short(key: str, value: Any) -> str:
        return (
            f"{value[:12]}..." if key == "head_sha256" and isinstance(value, str) else repr(value)
        )

    diffs = [
        f"{k} {short(k, saved.get(k))} -> {short(k, current.get(k))}"
        for k in ("dtype", "tokens", "head_sha256")
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        return f"data {saved.get('spec')!r} -> {current.get('spec')!r} ({', '.join(diffs)})"
    return None
