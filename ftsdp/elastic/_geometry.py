"""Batch geometry: a constant global batch split over however many ranks the job has now.

The micro-batch size and a step's micro-batches never depend on the world size, only their
assignment to ranks does (docs/elastic.md, "Batch geometry")."""

from __future__ import annotations

from dataclasses import dataclass


def valid_world_sizes(global_batch: int, micro_batch: int) -> list[int]:
    """Every world size that splits ``global_batch`` into whole micro-batches on each rank."""
    if global_batch < 1 or micro_batch < 1 or global_batch % micro_batch:
        return []
    n = global_batch // micro_batch
    return [w for w in range(1, n + 1) if n % w == 0]


@dataclass(frozen=True, kw_only=True)
class BatchGeometry:
    """How one optimizer step of ``global_batch`` samples runs on ``world_size`` ranks.

    Raises ``ValueError`` listing the world sizes that work when ``world_size`` cannot reach the
    global batch with whole micro-batches of ``micro_batch`` samples on every rank.
    """

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
        if self.micro_batches % self.world_size:
            works = valid_world_sizes(self.global_batch, self.micro_batch)
            raise ValueError(
                f"global_batch={self.global_batch} is not divisible by micro_batch="
                f"{self.micro_batch} * world_size={self.world_size}: the global batch must split "
                f"into whole micro-batches on every rank. World sizes that work: {works}; "
                "or change --micro-batch / --global-batch"
            )

    @property
    def micro_batches(self) -> int:
        """``G``: micro-batches per optimizer step, over all ranks."""
        return self.global_batch // self.micro_batch

    @property
    def accum_steps(self) -> int:
        """Micro-batches each rank runs per step (gradient accumulation steps)."""
        return self.micro_batches // self.world_size

    @property
    def samples_per_rank(self) -> int:
        return self.global_batch // self.world_size

    def global_micro_index(self, rank: int, micro: int) -> int:
        """Index in ``[0, G)`` of rank ``rank``'s ``micro``-th micro-batch of a step."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={self.world_size})")
        if not 0 <= micro < self.accum_steps:
            raise ValueError(f"micro={micro} must be in [0, accum_steps={self.accum_steps})")
        return rank * self.accum_steps + micro

    def sample_range(self, rank: int, micro: int) -> range:
        """Positions of that micro-batch's samples inside the step's ``global_batch``."""
        start = self.global_micro_index(rank, micro) * self.micro_batch
        return range(start, start + self.micro_batch)
