"""What a checkpoint records of the run, and the same-run check on resume (docs/training.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ftsdp import storage
from ftsdp.trainer._config import GPT_SPEC, ModelSpec, TrainConfig
from ftsdp.trainer._datasets import MARKOV, data_mismatch, markov_record
from ftsdp.trainer._models import hf_config_mismatch

# TrainConfig fields that change what is trained, whatever the model and data...
_ALWAYS = ("block_size", "seed", "global_batch")
# ... and those that shape the built-in GPT, or the synthetic language.
_GPT_FIELDS = ("vocab_size", "n_layer", "n_head", "n_embd")
_MARKOV_FIELDS = ("vocab_size",)
_MAX_DIFFS = 6


@dataclass(frozen=True)
class SavedRun:
    """The trainer values of a committed step (``trainer.<key>`` -> ``key``)."""

    step: int
    values: dict[str, Any]

    def record(self, key: str) -> dict[str, Any]:
        """``model`` or ``data`` decoded; a checkpoint that predates them: gpt / markov."""
        raw = self.values.get(key)
        if isinstance(raw, str):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                return value
        if key == "model":
            return {"spec": GPT_SPEC, "hf_config": None, "tokenizer_dir": None}
        return markov_record()

    def config(self) -> dict[str, Any]:
        """The saved ``TrainConfig`` as a dict (``trainer.config``); empty when unreadable."""
        try:
            value = json.loads(self.values.get("config") or "{}")
        except (TypeError, json.JSONDecodeError):
            return {}
        return value if isinstance(value, dict) else {}


def peek(
    url: str, *, storage_options: dict[str, Any] | None = None, rank: int = 0, world_size: int = 1
) -> SavedRun | None:
    """The trainer values of the newest committed step under ``url`` whose manifest reads (rank
    0 reads, then broadcasts: call it on every rank); None when nothing is committed."""
    msg: list[Any] = [None]
    if rank == 0:
        try:
            steps = storage.list_steps(url, storage_options=storage_options)
        except (storage.CheckpointError, OSError):
            steps = []  # the resume lists again and reports it
        for step in reversed(steps):
            try:
                manifest = storage.catalog.read_manifest(url, step, storage_options=storage_options)
            except (storage.CheckpointError, OSError):
                continue  # the resume falls back past it, loudly
            values = {
                k[len("trainer.") :]: v
                for k, v in manifest.values.items()
                if k.startswith("trainer.")
            }
            msg = [(step, values)]
            break
    if world_size > 1:
        dist.broadcast_object_list(msg, src=0)
    return None if msg[0] is None else SavedRun(*msg[0])


def mismatch(
    saved: SavedRun, cfg: TrainConfig, model: dict[str, Any], data: dict[str, Any]
) -> list[str]:
    """How the saved run differs from this one: ``["what: saved -> now", ...]``."""
    diffs: list[str] = []
    old_model, old_data, old_cfg = saved.record("model"), saved.record("data"), saved.config()
    old_kind = _kind(old_model.get("spec"))
    new_kind = ModelSpec.parse(cfg.model).kind
    fields = list(_ALWAYS)
    if old_kind != new_kind or (new_kind == "py" and old_model.get("spec") != cfg.model):
        diffs.append(f"model: {old_model.get('spec')!r} -> {cfg.model!r}")
    elif new_kind == "gpt":
        fields += _GPT_FIELDS
    elif new_kind == "hf":
        diffs += [
            f"hf config {d}"
            for d in hf_config_mismatch(old_model.get("hf_config") or {}, model["hf_config"] or {})
        ]
    why = data_mismatch(old_data, data)
    if why:
        diffs.append(why)
    elif data.get("spec") == MARKOV:
        fields += [f for f in _MARKOV_FIELDS if f not in fields]
    diffs += [
        f"{k}: {old_cfg.get(k)!r} -> {getattr(cfg, k)!r}"
        for k in fields
        if k in old_cfg and old_cfg[k] != getattr(cfg, k)
    ]
    return diffs


def refusal(url: str, step: int, diffs: list[str]) -> str:
    """The one line that refuses to resume another run's checkpoint."""
    shown = "; ".join(diffs[:_MAX_DIFFS]) + (
        f"; ... ({len(diffs)} differences)" if len(diffs) > _MAX_DIFFS else ""
    )
    return (
        f"the checkpoint at {url} (step {step}) was trained with another configuration: "
        f"{shown}; resume it with its own flags or use another --checkpoint-url"
    )


def _kind(spec: Any) -> str | None:
    try:
        return ModelSpec.parse(spec).kind
    except (ValueError, TypeError, AttributeError):
        return None
