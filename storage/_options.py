"""Keyword-only configuration of checkpoint I/O, saving and loading, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20


def _positive(owner: str, **fields: float) -> None:
    for name, value in fields.items():
        if not value > 0:
            raise ValueError(f"{owner}: {name}={value!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class IOOptions:
    """Concurrency, part size and retry policy of one rank's object I/O."""

    threads: int = 8  # uploads / ranged reads in flight per rank
    part_bytes: int = 32 * MiB  # multipart upload part size and the largest single ranged read
    max_attempts: int = 5  # tries per operation for known-transient errors
    backoff_s: float = 0.05  # first retry delay; doubles per attempt
    backoff_cap_s: float = 2.0  # the longest delay between two tries

    def __post_init__(self) -> None:
        _positive(
            "IOOptions",
            threads=self.threads,
            part_bytes=self.part_bytes,
            max_attempts=self.max_attempts,
            backoff_s=self.backoff_s,
            backoff_cap_s=self.backoff_cap_s,
        )


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How ``save`` lays out and writes a step."""

    object_bytes: int = 256 * MiB  # a data object holds at most this many payload bytes
    checksum_block_bytes: int = 1 * MiB  # one crc32 per block; bounds read amplification
    replica_split_bytes: int = 16 * MiB  # replicated ranges this big are split among holders
    staging_budget_bytes: int = 4096 * MiB  # host memory async save may hold at once
    reuse_staging: bool = True  # keep async save's staging buffers (<= budget) for the next one
    commit_timeout_s: float = 600.0  # how long rank 0 waits for the other ranks' objects
    io: IOOptions = field(default_factory=IOOptions)

    def __post_init__(self) -> None:
        _positive(
            "SaveOptions",
            object_bytes=self.object_bytes,
            checksum_block_bytes=self.checksum_block_bytes,
            replica_split_bytes=self.replica_split_bytes,
            staging_budget_bytes=self.staging_budget_bytes,
            commit_timeout_s=self.commit_timeout_s,
        )
        if self.checksum_block_bytes % 16:
            raise ValueError(
                f"SaveOptions: checksum_block_bytes={self.checksum_block_bytes} must be a "
                "multiple of 16 (the largest element size)"
            )


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How ``load`` reads: gaps up to ``coalesce_gap_bytes`` between ranged reads are merged."""

    coalesce_gap_bytes: int = 0
    io: IOOptions = field(default_factory=IOOptions)

    def __post_init__(self) -> None:
        if self.coalesce_gap_bytes < 0:
            raise ValueError(
                f"LoadOptions: coalesce_gap_bytes={self.coalesce_gap_bytes} must be >= 0"
            )
