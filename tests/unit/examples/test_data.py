"""The synthetic Markov language: determinism per (seed, index), independence from access order,
the documented achievable loss, and the per-rank sample geometry."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from ftsdp.examples.data import MarkovChain, MarkovDataset


@pytest.fixture(scope="module")
def ds() -> MarkovDataset:
    return MarkovDataset(64, 32, seed=7)


def test_item_is_a_shifted_walk_of_valid_transitions(ds: MarkovDataset) -> None:
    x, y = ds[5]
    assert x.shape == y.shape == (32,) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[1:], y[:-1])
    walk = torch.cat([x, y[-1:]]).tolist()
    assert all(0 <= t < 64 for t in walk)
    for a, b in itertools.pairwise(walk):
        assert b in ds.chain.successors[a], (a, b)


def test_items_depend_only_on_seed_and_index(ds: MarkovDataset) -> None:
    order = list(range(40))
    forward = {i: ds[i] for i in order}
    random.Random(0).shuffle(order)
    other = MarkovDataset(64, 32, seed=7)  # a fresh instance, as in another process
    for i in order:
        for a, b in zip(other[i], forward[i], strict=True):
            assert torch.equal(a, b), i
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    assert not torch.equal(ds[0][0], ds[1][0])
    assert not torch.equal(MarkovDataset(64, 32, seed=8)[0][0], ds[0][0])
    xb, yb = ds.batch(range(3, 6))
    assert xb.shape == (3, 32)
    assert torch.equal(xb[1], ds[4][0]) and torch.equal(yb[2], ds[5][1])
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_chain_is_fixed_by_its_seed() -> None:
    a, b, c = MarkovChain(32, seed=1), MarkovChain(32, seed=1), MarkovChain(32, seed=2)
    assert np.array_equal(a.successors, b.successors) and np.array_equal(a.probs, b.probs)
    assert not np.array_equal(a.successors, c.successors)
    np.testing.assert_allclose(a.probs.sum(1), 1.0)
    assert all(len(set(row)) == a.branching for row in a.successors.tolist())


def test_stationary_distribution_and_entropy_rate() -> None:
    chain = MarkovChain(64, branching=4, seed=3)
    P = chain.transition_matrix()
    np.testing.assert_allclose(chain.stationary @ P, chain.stationary, atol=1e-9)
    assert 0 < chain.entropy_rate < math.log(4)
    # The documented achievable loss: the true chain's mean NLL on samples is the entropy rate.
    ds = MarkovDataset(64, 64, seed=3, branching=4)
    x, y = ds.batch(range(300))
    nll = -np.log(P[x.numpy(), y.numpy()]).mean()
    assert nll == pytest.approx(ds.entropy_rate, abs=0.03)
    assert ds.uniform_loss == pytest.approx(math.log(64))


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size=1"):
        MarkovChain(1)
    with pytest.raises(ValueError, match="branching=9"):
        MarkovChain(8, branching=9)
    with pytest.raises(ValueError, match="seq_len=0"):
        MarkovDataset(8, 0)
