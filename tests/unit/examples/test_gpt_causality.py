"""The built-in GPT is causal: the logits at position t depend on tokens 0..t only.

Changing the tokens after t leaves the logits at 0..t bitwise unchanged (the attention mask
gives the later keys exactly zero weight, and every other layer works per position), and
changing the token at t changes the logits at t and after (a model that ignored its context, or
looked only at its own token, would pass the first check alone).
"""

from __future__ import annotations

import pytest
import torch

from ftsdp.examples.gpt import GPT, GPTConfig

VOCAB, SEQ = 50, 12


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=4, n_embd=32))
    return gpt.eval()


def _tokens(seed: int, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _other_tokens(x: torch.Tensor, start: int, seed: int) -> torch.Tensor:
    """``x`` with every token from ``start`` on replaced by a different token."""
    y = x.clone()
    shift = torch.randint(
        1, VOCAB, y[:, start:].shape, generator=torch.Generator().manual_seed(seed)
    )
    y[:, start:] = (y[:, start:] + shift) % VOCAB
    assert (y[:, start:] != x[:, start:]).all() and torch.equal(y[:, :start], x[:, :start])
    return y


@torch.no_grad()
@pytest.mark.parametrize("t", [0, 1, 5, SEQ - 2])
def test_later_tokens_leave_earlier_logits_unchanged(model: GPT, t: int) -> None:
    x = _tokens(1)
    y = _other_tokens(x, t + 1, seed=t)
    logits_x, _ = model(x)
    logits_y, _ = model(y)
    assert torch.equal(logits_x[:, : t + 1], logits_y[:, : t + 1])
    # The later positions see the changed tokens: they must differ (no vacuous pass).
    assert (logits_x[:, t + 1 :] != logits_y[:, t + 1 :]).any(-1).all()


@torch.no_grad()
@pytest.mark.parametrize("t", [0, 4, SEQ - 1])
def test_an_earlier_token_changes_every_later_logit(model: GPT, t: int) -> None:
    x = _tokens(2)
    y = x.clone()
    y[:, t] = (y[:, t] + 1) % VOCAB  # one token, in every sequence of the batch
    logits_x, _ = model(x)
    logits_y, _ = model(y)
    assert torch.equal(logits_x[:, :t], logits_y[:, :t])  # before t: unchanged
    changed = (logits_x[:, t:] != logits_y[:, t:]).any(-1)  # (batch, positions t..end)
    assert changed.all(), changed


@torch.no_grad()
def test_a_prefix_alone_gives_the_logits_of_the_whole_sequence(model: GPT) -> None:
    """What generation relies on: running the first t tokens alone gives the logits the full
    sequence has at those positions (other shapes may change the order of float sums inside the
    matrix products, so to within a few fp32 roundings of logits below 1: 1e-6)."""
    x = _tokens(3)
    full, _ = model(x)
    for t in (1, 6, SEQ - 1):
        prefix, _ = model(x[:, :t])
        torch.testing.assert_close(prefix, full[:, :t], rtol=1e-6, atol=1e-6)
