"""A checkpoint's optimizer set-up, param groups and RNG, each one JSON string (a key set that
does not change when torch adds a field); the walk of the engine's tensors kept between saves."""

from __future__ import annotations

import array
import base64
import json
import random
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ftsdp import storage

if TYPE_CHECKING:
    from ftsdp.checkpoint._engines import Engine


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state to load into: one ``step()`` with zero gradients and
    ``lr`` 0, gradients and learning rates put back; nothing when every parameter has state."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if all(optimizer.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        optimizer.step()
    except Exception as e:
        raise ValueError(
            f"CheckpointManager cannot create the state of {type(optimizer).__name__} to load a "
            f"checkpoint into: one step() with zero gradients and lr=0 failed ({type(e).__name__}: "
            f"{e}). Optimizers that need a closure (LBFGS) are not supported"
        ) from e
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            if lr is not None:
                group["lr"] = lr


def check_param_groups(saved: list[dict[str, Any]], mine: list[dict[str, Any]]) -> None:
    """Raise ``StateMismatchError`` unless the saved param groups (parsed JSON) name the same
    parameters, group by group, as the optimizer's now."""
    if [g["params"] for g in saved] != [g["params"] for g in mine]:
        raise storage.StateMismatchError(
            "the optimizer's param groups hold other parameters than the checkpoint's: saved "
            f"{[len(g['params']) for g in saved]} parameters per group, now "
            f"{[len(g['params']) for g in mine]}"
            + _first_difference([g["params"] for g in saved], [g["params"] for g in mine])
        )


def restore_param_groups(optimizer: torch.optim.Optimizer, saved_json: str, current: str) -> None:
    """Set the saved hyper-parameters on the optimizer's groups (same parameter names)."""
    saved, mine = json.loads(saved_json), json.loads(current)
    check_param_groups(saved, mine)
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        for key, value in values.items():
            if key == "params" or key not in group:
                continue
            now = group[key]
            if isinstance(now, torch.Tensor):
                with torch.no_grad():
                    now.copy_(torch.as_tensor(value, dtype=now.dtype))
            elif isinstance(now, tuple):
                group[key] = tuple(
                    n.new_tensor(v) if isinstance(n, torch.Tensor) else v
                    for n, v in zip(now, value, strict=True)
                )
            else:
                group[key] = value


def _first_difference(saved: list[list[str]], mine: list[list[str]]) -> str:
    for i, (a, b) in enumerate(zip(saved, mine, strict=False)):
        if a != b:
            only_saved = sorted(set(a) - set(b))[:3]
            only_mine = sorted(set(b) - set(a))[:3]
            return (
                f"; group {i}: only in the checkpoint {only_saved}, only in the optimizer "
                f"{only_mine}"
            )
    return ""


def rng_state() -> str:
    """This process's torch CPU, numpy and Python RNG states as one JSON string (key arrays as
    base64 of little-endian uint32 words; older checkpoints hold JSON lists)."""
    legacy = np.random.get_state()
    assert isinstance(legacy, tuple)  # the global generator is always an MT19937
    kind, keys, pos, has_gauss, gauss = legacy
    version, internal, gauss_next = random.getstate()
    # json.dumps of the whole would scan the base64 texts, which need no escaping: put in as is
    numpy = f'[{json.dumps(kind)}, "{_b64(keys)}", {int(pos)}, {int(has_gauss)}, {json.dumps(float(gauss))}]'
    python = f'[{int(version)}, "{_b64_ints(internal)}", {json.dumps(gauss_next)}]'
    torch_ = _b64(torch.get_rng_state().numpy())
    return f'{{"torch": "{torch_}", "numpy": {numpy}, "python": {python}}}'


def _b64(words: np.ndarray) -> str:
    return base64.b64encode(words.astype(words.dtype.newbyteorder("<"), copy=False).data).decode()


def _b64_ints(words: tuple[int, ...]) -> str:
    """``_b64`` of Python ints that fit in 32 bits (without a numpy array of them)."""
    packed = array.array("I", words)
    if packed.itemsize != 4:  # (a C unsigned int of another size)
        return _b64(np.asarray(words, dtype=np.uint32))
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed).decode()


def _words(saved: str | list[int]) -> np.ndarray:
    """uint32 words from ``_b64``'s text, or from the JSON list of older checkpoints."""
    if isinstance(saved, list):
        return np.asarray(saved, dtype=np.uint32)
    return np.frombuffer(base64.b64decode(saved), dtype="<u4").astype(np.uint32)


def set_rng_state(saved: str) -> None:
    """Restore what :func:`rng_state` returned (either form of its key arrays)."""
    state = json.loads(saved)
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, _words(keys), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(int(w) for w in _words(internal)), gauss_next))


def reseed(seed: int, step: int, rank: int) -> None:
    """Fresh, distinct per-rank RNG streams fixed by ``(seed, step, rank)``."""
    mixed = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0])
    torch.manual_seed(mixed)
    np.random.seed(mixed % (1 << 32))
    random.seed(mixed)


class KeptWalk:
    """The walk of the engine's tensor leaves (their names, ranges and rows) kept from one save
    to the next while the engine hands out the same leaves (the same generation); one object,
    the ``CheckpointManager``'s own (docs/elastic.md, "Saves that do not stop training")."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self.model: storage.saving.WalkedPart | None = None
        self.optim: storage.saving.WalkedPart | None = None
        self.buffers: list[str] = []  # the model leaves holding buffers, by full name

    def parts(self, engine: Engine, copy_buffers: bool) -> tuple[Any, Any, str]:
        """``(model, optimizer state, param groups JSON)`` for a state to save: walked parts,
        kept or made now (plain dicts when the walk fails: the save reports the error)."""
        generation, model, optim, groups = engine.tensor_leaves()
        if generation != self.generation or self.model is None or self.optim is None:
            self.generation = None
            try:
                self.model = storage.saving.walk_part(model, "model")
                self.optim = storage.saving.walk_part(optim, "optim.state")
            except Exception:  # any error: every rank must still reach the save's exchange
                return dict(model), {name: dict(entry) for name, entry in optim.items()}, groups
            self.buffers = [f"model.{name}" for name in engine.buffer_leaves(model)]
            self.generation = generation
        part = self.model
        if copy_buffers and self.buffers:
            locals_ = {n: part.tensors[n].local.detach().clone() for n in self.buffers}
            part = part.with_locals(locals_)
        return part, self.optim, groups
