"""Keyword-only configuration of checkpoint I/O, saving and loading, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20
GiB = 1 << 30

# [Note: manifest limits] A manifest is decoded whole before it is checked, so its size and
# nesting are capped first (docs/format.md, "Rules a reader enforces": why these values).
MAX_MANIFEST_BYTES = 1 * GiB
MAX_JSON_DEPTH = 64


def _positive(options: object, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if not value > 0:
            raise ValueError(f"{type(options).__name__}: {name}={value!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class IOOptions:
    """Concurrency, part size and retry policy of one rank's object I/O."""

    threads: int = 8  # uploads / ranged reads in flight per rank
    part_bytes: int = 32 * MiB  # multipart upload part size and the largest single ranged read
    max_attempts: int = 5  # tries per operation for known-transient errors
    backoff_s: float = 0.05  # first retry delay; doubles per attempt
    backoff_cap_s: float = 2.0  # the longest delay between two tries
    # S3 uploads send their CRC-32C as S3's own checksum, which S3 verifies on arrival (see
    # ``S3Upload``); False for an S3-compatible store that refuses CRC-32C checksums
    object_checksums: bool = True

    def __post_init__(self) -> None:
        _positive(self, "threads", "part_bytes", "max_attempts", "backoff_s", "backoff_cap_s")


@dataclass(frozen=True, kw_only=True)
class SaveOptions:
    """How ``save`` lays out, writes and retires a step.

    ``keep_last``/``keep_every``: retention after the commit (``catalog.apply_retention``; the
    step just saved is never removed); None: none. ``discard_newer``: newer committed steps (an
    abandoned timeline) and an earlier commit of this step are deleted once this step is
    committed; False: a save behind newer committed steps is refused."""

    object_bytes: int = 256 * MiB  # a data object holds at most this many payload bytes
    checksum_block_bytes: int = 1 * MiB  # one checksum per block; bounds read amplification
    replica_split_bytes: int = 16 * MiB  # replicated ranges this big are split among holders
    staging_budget_bytes: int = 4096 * MiB  # host memory async save may hold at once
    reuse_staging: bool = True  # keep async save's staging buffers (<= budget) for the next one
    commit_timeout_s: float = 600.0  # how long rank 0 waits for the other ranks' objects
    keep_last: int | None = None
    keep_every: int | None = None
    discard_newer: bool = False
    io: IOOptions = field(default_factory=IOOptions)

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"SaveOptions: {name}={value!r} must be an int >= 1 or None")
        _positive(self, "object_bytes", "checksum_block_bytes", "replica_split_bytes")
        _positive(self, "staging_budget_bytes", "commit_timeout_s")
        if self.checksum_block_bytes % 16:
            raise ValueError(
                f"SaveOptions: checksum_block_bytes={self.checksum_block_bytes} must be a "
                "multiple of 16 (the largest element size)"
            )


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How ``load`` reads: gaps up to ``coalesce_gap_bytes`` between ranged reads are merged; a
    manifest larger than ``max_manifest_bytes`` or nested deeper than ``max_json_depth`` levels
    of JSON arrays and objects is refused unread (see [Note: manifest limits]).

    ``inflight_bytes`` (None: no bound) bounds the host memory a rank's load from an object store
    holds beside its target. By default a rank holds everything it read, verified, until every
    rank has read, so that a failed load leaves every target untouched. With a bound, a rank
    reading more than that copies each verified part into its target as it arrives: its memory
    stays the state plus the bound, and a failure partway leaves its target partly loaded."""

    coalesce_gap_bytes: int = 0
    inflight_bytes: int | None = None
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    io: IOOptions = field(default_factory=IOOptions)

    def __post_init__(self) -> None:
        if self.coalesce_gap_bytes < 0:
            raise ValueError(
                f"LoadOptions: coalesce_gap_bytes={self.coalesce_gap_bytes} must be >= 0"
            )
        _positive(self, "max_manifest_bytes", "max_json_depth")
        if self.inflight_bytes is not None:
            _positive(self, "inflight_bytes")
