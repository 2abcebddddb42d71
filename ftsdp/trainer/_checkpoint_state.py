"""The checkpoint state of a wrapped model and its optimizer, as storage leaves.

The engine hands out ``ShardView``s (docs/design.md, "The engine/storage seam"); each becomes a
``storage.FlatShard`` over the same live tensor, so ``storage.save`` reads the shards and
``storage.load`` fills them in place. Everything that is not a tensor (param group
hyper-parameters, LR scheduler, RNG states) is one JSON string per entry, so a checkpoint's key
set does not change when torch adds a field to a scheduler's state dict.
"""

from __future__ import annotations

import base64
import json
import random
from typing import Any

import numpy as np
import torch

from ftsdp import storage


def _flat(view: Any) -> storage.FlatShard:
    return storage.FlatShard(tuple(view.global_shape), view.offset, view.local)


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``{name: FlatShard}`` aliasing the live shards (parameters and persistent buffers)."""
    return {name: _flat(view) for name, view in model.sharded_state_dict().items()}


def optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {param: {key: FlatShard | tensor}}, "param_groups": json}``, aliasing the
    optimizer's live state tensors (``step`` stays a whole 0-dim tensor, the same on every
    rank, which storage writes once)."""
    sd = model.sharded_optim_state_dict(optimizer)
    state = {
        name: {
            key: _flat(v) if hasattr(v, "global_shape") else v
            for key, v in entry.items()
            if isinstance(v, torch.Tensor) or hasattr(v, "global_shape")
        }
        for name, entry in sd["state"].items()
    }
    return {"state": state, "param_groups": json.dumps(sd["param_groups"], sort_keys=True)}


_ADAM_LIKE = (torch.optim.Adam, torch.optim.AdamW)


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a fresh Adam/AdamW would have after its first step (zeros, step 0), so
    that a checkpoint can be loaded into it in place. Does nothing when state exists already."""
    if not isinstance(optimizer, _ADAM_LIKE):
        if any(p.requires_grad for g in optimizer.param_groups for p in g["params"]) and not (
            isinstance(optimizer, torch.optim.SGD)
            and all(g.get("momentum", 0) == 0 for g in optimizer.param_groups)
        ):
            raise ValueError(
                f"CheckpointManager can resume {', '.join(c.__name__ for c in _ADAM_LIKE)} and "
                f"SGD without momentum; got {type(optimizer).__name__}"
            )
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            state = {
                "step": torch.zeros(
                    (),
                    dtype=torch.float32,
                    device=p.device if group.get("capturable") or group.get("fused") else "cpu",
                ),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def restore_param_groups(optimizer: torch.optim.Optimizer, saved_json: str, current: str) -> None:
    """Set the saved hyper-parameters on the optimizer's groups (same parameters required)."""
    saved, mine = json.loads(saved_json), json.loads(current)
    if [g["params"] for g in saved] != [g["params"] for g in mine]:
        raise storage.StateMismatchError(
            "the optimizer's param groups hold other parameters than the checkpoint's: saved "
            f"{[len(g['params']) for g in saved]} parameters per group, now "
            f"{[len(g['params']) for g in mine]}"
        )
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        for key, value in values.items():
            if key == "params" or key not in group:
                continue
            group[key] = tuple(value) if isinstance(group[key], tuple) else value


# -- RNG states ---------------------------------------------------------------------------------


def rng_state() -> str:
    """This process's torch CPU, numpy and Python RNG states as one JSON string."""
    np_state = np.random.get_state()
    return json.dumps(
        {
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "numpy": [np_state[0], np_state[1].tolist(), *map(_plain, np_state[2:])],
            "python": _plain(random.getstate()),
        }
    )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def set_rng_state(saved: str) -> None:
    state = json.loads(saved)
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def reseed(seed: int, step: int, rank: int) -> None:
    """Fresh, distinct per-rank RNG streams fixed by ``(seed, step, rank)``."""
    mixed = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0])
    torch.manual_seed(mixed)
    np.random.seed(mixed % (1 << 32))
    random.seed(mixed)
