"""The main job's data; sample ``i`` depends only on ``(seed, i)`` (docs/training.md)."""

from __future__ import annotations

import bisect
import math

import numpy as np
import torch
from torch.utils.data import Dataset

# Distinct SeedSequence spawn keys keep the chain's stream and the samples' streams apart.
_CHAIN_STREAM = 0
_SAMPLE_STREAM = 1
_WINDOW_STREAM = 2


def _sample_index(i: int, n: int, what: str) -> int:
    """``i`` as an index into ``n`` samples (negative from the end); IndexError outside."""
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"{what} index {i} out of range [0, {n})")
    return i


class _Samples(Dataset):
    """What both datasets share: ``num_samples`` items of ``(input, target)``."""

    num_samples: int

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: list[int] | range) -> tuple[torch.Tensor, torch.Tensor]:
        """Items ``indices`` stacked into ``(len(indices), seq_len)`` inputs and targets."""
        pairs = [self[i] for i in indices]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


class MarkovChain:
    """A random sparse transition table over ``vocab_size`` tokens, fixed by ``seed``."""

    def __init__(self, vocab_size: int, *, branching: int = 4, seed: int = 0):
        if vocab_size < 2:
            raise ValueError(f"MarkovChain: vocab_size={vocab_size} must be >= 2")
        if not 1 <= branching <= vocab_size:
            raise ValueError(
                f"MarkovChain: branching={branching} must be in [1, vocab_size={vocab_size}]"
            )
        self.vocab_size = vocab_size
        self.branching = branching
        rng = np.random.default_rng([seed, _CHAIN_STREAM])
        # successors[s] holds the `branching` tokens that may follow token s, probs[s] their odds.
        self.successors = np.stack(
            [rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
        )  # (V, K) int64
        self.probs = rng.dirichlet(np.ones(branching), size=vocab_size)  # (V, K), rows sum to 1
        self._cdf = np.cumsum(self.probs, axis=1)
        self._cdf[:, -1] = 1.0  # exact, so a uniform draw in [0, 1) always lands in a bucket
        self.stationary = self._stationary()
        self._stationary_cdf = np.cumsum(self.stationary)
        self._stationary_cdf[-1] = 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            row_entropy = -np.sum(np.where(self.probs > 0, self.probs * np.log(self.probs), 0), 1)
        self.entropy_rate = float(self.stationary @ row_entropy)
        # plain lists: the per-token walk is a Python loop, bisecting them (no numpy scalars)
        self._succ_rows = self.successors.tolist()
        self._cdf_rows = self._cdf.tolist()
        self._stationary_cdf_list = self._stationary_cdf.tolist()

    def transition_matrix(self) -> np.ndarray:
        """The dense (V, V) matrix ``P[s, t] = Pr(next = t | current = s)``."""
        P = np.zeros((self.vocab_size, self.vocab_size))
        np.put_along_axis(P, self.successors, self.probs, axis=1)
        return P

    def _stationary(self) -> np.ndarray:
        # Power iteration on the lazy chain (I + P) / 2: it has the same stationary
        # distributions as P and converges even where P is periodic.
        P = self.transition_matrix()
        pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
        for _ in range(10_000):
            nxt = 0.5 * (pi + pi @ P)
            if np.abs(nxt - pi).sum() < 1e-13:
                break
            pi = nxt
        return nxt / nxt.sum()

    def sample(self, length: int, rng: np.random.Generator) -> np.ndarray:
        """A walk of ``length`` tokens starting from a stationary draw."""
        u = rng.random(length).tolist()
        tok = min(bisect.bisect_right(self._stationary_cdf_list, u[0]), self.vocab_size - 1)
        walk = [tok]
        for t in range(1, length):
            k = bisect.bisect_right(self._cdf_rows[tok], u[t])
            tok = self._succ_rows[tok][min(k, self.branching - 1)]
            walk.append(tok)
        return np.asarray(walk, dtype=np.int64)


class MarkovDataset(_Samples):
    """Item ``i``: ``(input, target)``, (seq_len,) int64 tensors of one walk fixed by ``(seed,
    i)``, ``target`` shifted by one, made on access (``num_samples`` only bounds the index)."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        branching: int = 4,
        num_samples: int = 1 << 40,
    ):
        if seq_len < 1:
            raise ValueError(f"MarkovDataset: seq_len={seq_len} must be >= 1")
        if num_samples < 1:
            raise ValueError(f"MarkovDataset: num_samples={num_samples} must be >= 1")
        self.chain = MarkovChain(vocab_size, branching=branching, seed=seed)
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = num_samples

    @property
    def entropy_rate(self) -> float:
        """The achievable mean cross-entropy (nats per token) of a perfect model."""
        return self.chain.entropy_rate

    @property
    def uniform_loss(self) -> float:
        """``ln(vocab_size)``: the loss of a uniform prediction, about a fresh model's loss."""
        return math.log(self.chain.vocab_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = _sample_index(i, self.num_samples, "MarkovDataset")
        rng = np.random.default_rng([self.seed, _SAMPLE_STREAM, i])
        walk = torch.from_numpy(self.chain.sample(self.seq_len + 1, rng))
        return walk[:-1], walk[1:]


class TokenDataset(_Samples):
    """Item ``i``: ``(input, target)`` from the window of ``seq_len + 1`` tokens at an offset
    drawn with ``(seed, i)``; ``len``: ``(len(tokens) - 1) // seq_len`` (docs/training.md)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, *, seed: int = 0):
        if tokens.ndim != 1:
            raise ValueError(f"TokenDataset: tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1:
            raise ValueError(f"TokenDataset: seq_len={seq_len} must be >= 1")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"TokenDataset: {len(tokens)} tokens are fewer than one window of seq_len + 1 = "
                f"{seq_len + 1}; use more data or a smaller block size"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_samples = (len(tokens) - 1) // seq_len

    def max_token(self, chunk: int = 1 << 26) -> int:
        """The largest token id in the array (read once, ``chunk`` tokens at a time)."""
        return max(int(self.tokens[a : a + chunk].max()) for a in range(0, len(self.tokens), chunk))

    def offset(self, i: int) -> int:
        """Where item ``i``'s window starts: uniform in ``[0, len(tokens) - seq_len)``."""
        i = _sample_index(i, self.num_samples, "TokenDataset")
        rng = np.random.default_rng([self.seed, _WINDOW_STREAM, i])
        return int(rng.integers(len(self.tokens) - self.seq_len))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.offset(i)
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]
