"""A small GPT-2-like decoder (pre-LN blocks, output head tied to the token embedding).

[Note: per-module init] Every parameterised leaf module initialises itself in its own
``reset_parameters()``, never a parent, and a tied head nothing: a meta-device model materialised
in ``modules()`` order reproduces ``GPT(config)`` (docs/engine.md, "Deferred initialisation")."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )


class InitLinear(nn.Linear):
    """``nn.Linear`` with GPT-2 init: weight ~ normal(0, init_std), bias = 0; ``init_std=None``
    leaves the weight to the module owning it (a tied head: the RNG is consumed once)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float | None):
        self.init_std = init_std  # read by reset_parameters(), which nn.Linear's init calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        if self.init_std is not None:
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class InitEmbedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2 init: weight ~ normal(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)


def _linear(config: GPTConfig, n_in: int, n_out: int, *, residual: bool = False) -> InitLinear:
    """A block's linear layer; residual projections scaled down (depth-independent variance)."""
    std = INIT_STD / math.sqrt(2 * config.n_layer) if residual else INIT_STD
    return InitLinear(n_in, n_out, bias=config.bias, init_std=std)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = _linear(config, config.n_embd, 3 * config.n_embd)
        self.c_proj = _linear(config, config.n_embd, config.n_embd, residual=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = _linear(config, config.n_embd, 4 * config.n_embd)
        self.c_proj = _linear(config, 4 * config.n_embd, config.n_embd, residual=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """One pre-LN transformer block: the unit the training entry wraps."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = InitEmbedding(config.vocab_size, config.n_embd)
        self.wpe = InitEmbedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = InitLinear(
            config.n_embd,
            config.vocab_size,
            bias=False,
            init_std=None if config.tie_weights else INIT_STD,
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Tie the head to the token embedding (if configured); call again after ``to_empty()``."""
        if self.config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def init_weights(self) -> None:
        """Re-initialise every parameter in ``modules()`` order: ``GPT(config)``'s init."""
        for module in self.modules():
            if callable(reset := getattr(module, "reset_parameters", None)):
                reset()

    def num_parameters(self) -> int:
        """Distinct parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: (B, T) token ids, T <= block_size. Returns logits (B, T, V) and the mean
        cross-entropy against ``targets`` (B, T), or None without targets."""
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length T={T} exceeds block_size={self.config.block_size}; "
                "build the model with a larger block_size or feed shorter sequences"
            )
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


def default_no_decay(name: str) -> bool:
    """True for parameters that get no weight decay: biases and normalisation weights, by name
    (under FSDP every parameter a rank sees is 1-D, so nanoGPT's ``p.dim() >= 2`` cannot tell)."""
    *modules, last = name.split(".")
    return last == "bias" or any(p.startswith("ln") or "norm" in p.lower() for p in modules)


def param_groups(
    model: nn.Module | Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    no_decay: Callable[[str], bool] = default_no_decay,
) -> list[dict]:
    """Two AdamW param groups, ``[{decay params, weight_decay}, {no-decay params, 0.0}]``, from a
    module or ``(name, param)`` pairs; frozen parameters left out, a tied one kept once."""
    named = model.named_parameters() if isinstance(model, nn.Module) else model
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in named:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (keep if no_decay(name) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
