"""Batch geometry and a world-size-independent sample order (docs/elastic.md, "Sample order")."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

from torch.utils.data import Sampler

_M64 = (1 << 64) - 1
_ROUNDS = 6


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


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-mixing bijection on 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class _Permutation:
    """A bijection of ``range(n)`` keyed by ``key``: a Feistel network, cycle walking into it."""

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2  # domain 2**(2*half) < 4n: cycle walking takes < 4 tries
        self.mask = (1 << self.half) - 1
        self.keys = [_mix64(key * _ROUNDS + i) for i in range(_ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix64(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x


class GlobalSampler:
    """Global sample position -> dataset index, the same everywhere (``shuffle=False``: ordered)."""

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"GlobalSampler: num_samples={num_samples!r} must be an int >= 1")
        if seed < 0:
            raise ValueError(f"GlobalSampler: seed={seed} must be >= 0")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        # epoch -> its permutation; only the current epoch (and a neighbour) is ever hot
        self._perm = functools.lru_cache(maxsize=4)(self._new_perm)

    def _new_perm(self, epoch: int) -> _Permutation:
        return _Permutation(self.num_samples, _mix64(self.seed) ^ _mix64(epoch + 1))

    def index(self, position: int) -> int:
        """The dataset index at ``position`` (>= 0) of the global stream."""
        if position < 0:
            raise ValueError(f"position={position} must be >= 0")
        epoch, i = divmod(position, self.num_samples)
        return self._perm(epoch)(i) if self.shuffle else i

    def indices(self, start: int, count: int) -> list[int]:
        """Dataset indices of positions ``[start, start + count)``."""
        return [self.index(p) for p in range(start, start + count)]

    def step_indices(self, cursor: int, global_batch: int) -> list[int]:
        """Every dataset index of the step that starts at ``cursor``, in global order."""
        return self.indices(cursor, global_batch)

    def micro_batch(self, cursor: int, geometry: BatchGeometry, rank: int, micro: int) -> list[int]:
        """Dataset indices of rank ``rank``'s ``micro``-th micro-batch of the step at ``cursor``."""
        r = geometry.sample_range(rank, micro)
        return self.indices(cursor + r.start, len(r))


class RankBatchSampler(Sampler[list[int]]):
    """A ``DataLoader`` batch sampler: ``rank``'s micro-batches from sample ``cursor`` for
    ``steps`` steps (None: forever); a prefetching loader runs ahead: checkpoint your own cursor."""

    def __init__(
        self,
        sampler: GlobalSampler,
        geometry: BatchGeometry,
        rank: int,
        *,
        cursor: int = 0,
        steps: int | None = None,
    ) -> None:
        geometry.share(rank)  # validates the rank
        self.sampler, self.geometry, self.rank = sampler, geometry, rank
        self.cursor, self.steps = cursor, steps

    def __iter__(self) -> Iterator[list[int]]:
        cursor, done = self.cursor, 0
        while self.steps is None or done < self.steps:
            for micro in range(self.geometry.share(self.rank)):
                yield self.sampler.micro_batch(cursor, self.geometry, self.rank, micro)
            cursor += self.geometry.global_batch
            done += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("RankBatchSampler without steps= is infinite")
        return self.steps * self.geometry.share(self.rank)
