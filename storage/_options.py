"""Keyword-only configuration of checkpoint I/O, saving and loading, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MiB = 1 << 20
GiB = 1 << 30

# [Note: manifest limits]
# A manifest is read whole and decoded before anything is checked, so its size and nesting are
# capped first. A piece costs about 170 bytes of manifest (plus 11 per checksum block): a 70B
# model with Adam state saved by 512 ranks with FSDP2 (every tensor cut into 512 pieces) has
# about a million pieces, ~200 MB. 1 GiB leaves room for five times that and still refuses a
# manifest that would take tens of GiB to decode. The format's own structure nests 6 levels; the
# rest of ``MAX_JSON_DEPTH`` is for the non-tensor values a user saves (lists inside lists).
MAX_MANIFEST_BYTES = 1 * GiB
MAX_JSON_DEPTH = 64


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
    # S3 uploads send their CRC-32C as S3's own checksum, which S3 verifies on arrival (see
    # ``S3Upload``); False for an S3-compatible store that refuses CRC-32C checksums
    object_checksums: bool = True

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
    """How ``save`` lays out, writes and retires a step.

    ``keep_last``: after the commit, rank 0 keeps the newest ``keep_last`` committed steps and,
    with ``keep_every``, every step divisible by it (see ``catalog.apply_retention``; the step
    just saved is never removed); None: no retention. ``discard_newer``: the committed steps
    newer than this one belong to an abandoned timeline (a resume fell back past them) and are
    deleted, with an earlier commit of this step, once this step is committed; False: a save
    behind newer committed steps is refused."""

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
    """How ``load`` reads: gaps up to ``coalesce_gap_bytes`` between ranged reads are merged; a
    manifest larger than ``max_manifest_bytes`` or nested deeper than ``max_json_depth`` levels
    of JSON arrays and objects is refused unread (see [Note: manifest limits])."""

    coalesce_gap_bytes: int = 0
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    io: IOOptions = field(default_factory=IOOptions)

    def __post_init__(self) -> None:
        if self.coalesce_gap_bytes < 0:
            raise ValueError(
                f"LoadOptions: coalesce_gap_bytes={self.coalesce_gap_bytes} must be >= 0"
            )
        _positive(
            "LoadOptions",
            max_manifest_bytes=self.max_manifest_bytes,
            max_json_depth=self.max_json_depth,
        )
