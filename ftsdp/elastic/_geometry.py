"""Batch geometry: a constant global batch split over however many ranks the job has now; rank
r runs the r-th contiguous block of a step's micro-batches (docs/elastic.md, "Batch geometry")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BatchGeometry:
    """How one optimizer step of ``global_batch`` samples runs on ``world_size`` ranks (any);
    ``global_batch`` must be a multiple of ``micro_batch`` (else ``ValueError``)."""

    global_batch: int
    micro_batch: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batch", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchGeometry: {name}={value!r} must be a positive int")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"BatchGeometry: global_batch={self.global_batch} must be a multiple of "
                f"micro_batch={self.micro_batch}"
            )

    @property
    def micro_batches(self) -> int:
        """``G``: micro-batches per optimizer step, over all ranks."""
        return self.global_batch // self.micro_batch

    @property
    def accum_steps(self) -> int:
        """Passes every rank runs per step: ``ceil(G / W)`` (a smaller :meth:`share` pads)."""
        return -(-self.micro_batches // self.world_size)

    def share(self, rank: int) -> int:
        """How many of the step's micro-batches rank ``rank`` runs (0 when ``W > G``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={self.world_size})")
        base, extra = divmod(self.micro_batches, self.world_size)
        return base + (rank < extra)

    def global_micro_index(self, rank: int, micro: int) -> int:
        """Index in ``[0, G)`` of rank ``rank``'s ``micro``-th micro-batch of a step."""
        if not 0 <= micro < self.share(rank):
            raise ValueError(
                f"micro={micro} must be in [0, share={self.share(rank)}) of rank {rank}"
            )
        base, extra = divmod(self.micro_batches, self.world_size)
        return rank * base + min(rank, extra) + micro

    def sample_range(self, rank: int, micro: int) -> range:
        """Positions of that micro-batch's samples inside the step's ``global_batch``."""
        start = self.global_micro_index(rank, micro) * self.micro_batch
        return range(start, start + self.micro_batch)
