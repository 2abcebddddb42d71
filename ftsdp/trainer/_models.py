"""What the main job trains (``--model``), its loss adapter, ``--init-from`` (docs/training.md)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ftsdp
from ftsdp import storage
from ftsdp.examples.gpt import GPT, Block
from ftsdp.trainer._config import ModelSpec, TrainConfig
from ftsdp.trainer._errors import JobError

logger = logging.getLogger(__name__)

# Files whose presence makes an hf: directory a tokenizer directory too (recorded for export).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "special_tokens_map.json",
)
# Keys of a transformers config that say nothing about the model's shape or math.
_VOLATILE_HF_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "architectures",
        "dtype",
        "torch_dtype",
        "use_cache",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "_attn_implementation_autoset",
    }
)

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
Policy = Any  # a set of nn.Module classes, a callable module -> bool, or None (ftsdp.FSDP)


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The built-in GPT: ``model(x, y)`` returns ``(logits, loss)``."""
    return model(x, y)[1]


def causal_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A ``transformers`` causal LM: cross-entropy of ``model(input_ids=x).logits`` against
    ``y`` in fp32 (the window is already shifted: the same value as passing ``labels``)."""
    out = model(input_ids=x, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def module_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The ``py:`` contract: ``model(x, y)`` returns the loss (0-dim) or ``(logits, loss)``."""
    out = model(x, y)
    if isinstance(out, (tuple, list)) and len(out) == 2:
        out = out[1]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        raise JobError(
            f"the model returned {type(out).__name__}"
            + (f" of shape {list(out.shape)}" if isinstance(out, torch.Tensor) else "")
            + " for model(x, y); a py: model must return the mean loss (a 0-dim tensor) or "
            "(logits, loss)"
        )
    return out


def no_split_policy(module: nn.Module) -> set[type[nn.Module]] | None:
    """The classes a ``transformers`` model names in ``_no_split_modules`` (its decoder layers),
    as an ``auto_wrap_policy``; None (one unit) when it names none that it holds."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    classes = {type(m) for m in module.modules() if type(m).__name__ in names}
    if not classes:
        logger.warning(
            "%s names no _no_split_modules it holds: the whole model is one FSDP unit "
            "(gathered at once); pass a policy from a py: factory to shard it finer",
            type(module).__name__,
        )
        return None
    return classes


def model_vocab(module: nn.Module) -> int | None:
    """The number of token ids ``module`` embeds, when it can be told (else None)."""
    get = getattr(module, "get_input_embeddings", None)
    if callable(get):
        emb = get()
        if isinstance(emb, nn.Embedding):
            return emb.num_embeddings
    value = getattr(getattr(module, "config", None), "vocab_size", None)
    return value if isinstance(value, int) else None


def model_positions(module: nn.Module) -> int | None:
    """The longest sequence ``module`` is configured for, when it says (else None)."""
    config = getattr(module, "config", None)
    for name in ("max_position_embeddings", "n_positions", "block_size"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def has_dropout(module: nn.Module) -> bool:
    """Whether any ``nn.Dropout`` of ``module`` drops something (p > 0)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def hf_config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config as plain JSON (every key, not only those off the defaults)."""
    return json.loads(config.to_json_string(use_diff=False))


def hf_config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The keys (but bookkeeping ones) whose values differ, as ``key: saved -> current``."""
    keys = sorted((set(saved) | set(current)) - _VOLATILE_HF_KEYS)
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]


@dataclass
class ModelPlan:
    """``--model`` resolved without weights: its record (``trainer.model``), an ``hf:`` config."""

    spec: ModelSpec
    record: dict[str, Any]
    hf_config: Any = field(default=None, repr=False)


@dataclass
class BuiltModel:
    """The unwrapped module (on the CPU), its wrap policy and its loss adapter."""

    module: nn.Module
    policy: Policy
    loss: LossFn
    init: InitPlan | None = None  # --init-from, checked; read after wrapping (init_sharded)


def plan_model(cfg: TrainConfig) -> ModelPlan:
    """Resolve ``cfg.model`` cheaply (an ``hf:`` config.json); JobError when it cannot be."""
    spec = ModelSpec.parse(cfg.model)
    record: dict[str, Any] = {"spec": cfg.model, "hf_config": None, "tokenizer_dir": None}
    if spec.kind != "hf":
        return ModelPlan(spec, record)
    path = os.path.abspath(os.path.expanduser(spec.arg))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise JobError(
            f"--model {cfg.model}: no config.json in {path}; write one with "
            "transformers' config.save_pretrained(DIR)"
        )
    try:
        import transformers
    except ImportError:
        raise JobError(
            f"--model {cfg.model} needs transformers: pip install 'ftsdp[hf]' "
            "(or pip install transformers)"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JobError(
            f"--model {cfg.model}: transformers cannot read {path}/config.json: {first}"
        ) from None
    record["hf_config"] = hf_config_dict(config)
    if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        record["tokenizer_dir"] = path
    return ModelPlan(spec, record, config)


def build_model(cfg: TrainConfig, plan: ModelPlan) -> BuiltModel:
    """Build the module on the CPU (call under ``torch.manual_seed(cfg.seed)``: every rank must
    get the same init). Completes ``plan.record`` for a ``py:`` factory's ``transformers`` model."""
    spec = plan.spec
    if spec.kind == "gpt":
        return BuiltModel(GPT(cfg.model_config()), {Block}, gpt_loss)
    if spec.kind == "hf":
        transformers = sys.modules["transformers"]
        try:
            module = transformers.AutoModelForCausalLM.from_config(plan.hf_config)
        except ValueError as e:  # e.g. a config of no causal LM, or one that needs remote code
            first = str(e).strip().splitlines()[0]
            raise JobError(f"--model {cfg.model}: no causal LM for this config: {first}") from None
        module = module.float()  # fp32 master weights whatever the config's dtype
        return BuiltModel(module, no_split_policy(module), causal_lm_loss)
    module_name, fn_name = spec.arg.split(":")
    try:
        factory_module = importlib.import_module(module_name)
    except ImportError as e:
        raise JobError(
            f"--model {cfg.model}: cannot import {module_name} ({e}); put it in the working "
            "directory or on PYTHONPATH"
        ) from None
    factory = getattr(factory_module, fn_name, None)
    if not callable(factory):
        raise JobError(f"--model {cfg.model}: {module_name} has no function {fn_name}")
    out = factory(cfg)
    policy: Policy = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        out, policy = out
    elif not isinstance(out, nn.Module):
        raise JobError(
            f"--model {cfg.model}: {fn_name}(cfg) returned {type(out).__name__}; it must return "
            "an nn.Module or (nn.Module, auto_wrap_policy)"
        )
    hf = sys.modules.get("transformers")  # imported by any transformers model
    if hf is not None and isinstance(out, hf.PreTrainedModel):
        plan.record["hf_config"] = hf_config_dict(out.config)
        return BuiltModel(
            out, policy if policy is not None else no_split_policy(out), causal_lm_loss
        )
    return BuiltModel(out, policy, module_loss)


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Every parameter registered inside moves to the meta device as it is registered; buffers
    stay real (docs/training.md, "--init-from")."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # attributes some libraries set on parameters
            param = meta
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_deferred(cfg: TrainConfig, plan: ModelPlan) -> BuiltModel | None:
    """:func:`build_model` with its parameters on the meta device (:func:`params_on_meta`), or
    None (the caller builds it eagerly) when the build fails that way or leaves a buffer on
    meta (a value computed from parameters: no checkpoint can give a non-persistent one)."""
    try:
        with params_on_meta():
            built = build_model(cfg, plan)
    except JobError:
        raise
    except Exception as e:  # a factory that reads parameter values while building
        logger.debug("--init-from: the model cannot be built on meta (%s); building it whole", e)
        return None
    if any(b.is_meta for b in built.module.buffers()):
        logger.debug("--init-from: the model has buffers derived from meta parameters")
        return None
    return built


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


@dataclass
class InitPlan:
    """``--init-from`` checked against the unwrapped model: what to read and from where."""

    url: str
    step: int | None  # the ftsdp step read (pinned: a newer commit does not change it)
    prefix: str  # "" or "model.": the names that matched
    names: dict[str, str]  # every state-dict key of the model -> its checkpoint name
    source: str  # "URL (format, step N)"

    @property
    def where(self) -> str:
        return f"--init-from {self.source}"


def plan_init(
    module: nn.Module, url: str, *, storage_options: dict[str, Any] | None = None
) -> InitPlan:
    """Check the checkpoint at ``url`` against ``module`` without reading a tensor (names bare or
    under ``model.``); :class:`JobError` naming what does not match."""
    try:
        with storage.LazyStateDict(url, storage_options=storage_options) as src:
            fmt, step = src.format, src.step
            shapes = {n: tuple(src.info(n).shape) for n in src}
    except (storage.CheckpointError, ValueError, OSError) as e:
        raise JobError(f"--init-from {url}: cannot read it: {type(e).__name__}: {e}") from None
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for key, t in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(key)
        tensors[id(t)] = t
    known = {k for keys in groups.values() for k in keys}

    def fit(prefix: str) -> tuple[int, str, list[str], list[str]]:
        saved = {n[len(prefix) :] for n in shapes if n.startswith(prefix)}
        missing = sorted(keys[0] for keys in groups.values() if not saved.intersection(keys))
        unexpected = sorted(saved - known)
        return len(missing) + len(unexpected), prefix, missing, unexpected

    # the prefix that matches best; a tie goes to the bare names
    _, prefix, missing, unexpected = min(map(fit, ("", "model.")), key=lambda f: f[0])
    source = f"{url} ({fmt}" + (f", step {step})" if step is not None else ")")
    where = f"--init-from {source}"
    if missing or unexpected:
        raise JobError(
            f"{where} does not match the model: {len(missing)} missing"
            + (f" ({_few(missing)})" if missing else "")
            + f", {len(unexpected)} unexpected"
            + (f" ({_few(unexpected)})" if unexpected else "")
            + (f"; it holds {len(shapes)} tensors ({_few(sorted(shapes))})" if missing else "")
            + "; pass a checkpoint of this model (names as in the model, or under 'model.' as "
            "an ftsdp run saves them)"
        )
    bad = []
    names: dict[str, str] = {}
    for tid, keys in groups.items():
        hit = next(k for k in keys if prefix + k in shapes)
        names.update(dict.fromkeys(keys, prefix + hit))  # tied keys read the one saved
        if shapes[prefix + hit] != tuple(tensors[tid].shape):
            bad.append(f"{hit} {list(shapes[prefix + hit])} vs {list(tensors[tid].shape)}")
    if bad:
        raise JobError(f"{where} has other shapes than the model (saved vs model): {_few(bad)}")
    return InitPlan(url, step, prefix, names, source)


def init_weights(
    module: nn.Module, url: str, *, storage_options: dict[str, Any] | None = None
) -> str:
    """Fill the unwrapped ``module`` from the checkpoint at ``url``, every tensor whole, all or
    nothing; a one-line description, :class:`JobError` if it cannot."""
    plan = plan_init(module, url, storage_options=storage_options)
    try:
        storage.load_into(
            module, url, plan.step, prefix=plan.prefix, storage_options=storage_options
        )
    except (storage.CheckpointError, OSError) as e:
        raise JobError(f"{plan.where}: loading failed: {type(e).__name__}: {e}") from None
    return f"initialised from {plan.source}"


def init_sharded(
    model: ftsdp.FSDP, plan: InitPlan, *, storage_options: dict[str, Any] | None = None
) -> str:
    """Fill a wrapped ``model`` from ``plan`` (:func:`plan_init` of the unwrapped model): each
    rank reads only its own shards' ranges, all before writing any (docs/training.md); a
    one-line description, :class:`JobError` if it cannot."""
    views = model.sharded_state_dict()
    unknown = sorted(k for k in views if k not in plan.names)
    if unknown:  # the wrapped model names what the unwrapped one did: a bug if not
        raise JobError(f"{plan.where}: the wrapped model has keys the plan lacks: {_few(unknown)}")
    # A view of a tensor that is not contiguous (a buffer, an ignored parameter) is a copy:
    # read into it, then copy it back into the tensor.
    state = model.module.state_dict(keep_vars=True)
    copies = [(state[k], v.local) for k, v in views.items() if not state[k].is_contiguous()]
    requests = [(plan.names[k], v.offset, v.local) for k, v in views.items() if v.length]
    try:
        with storage.LazyStateDict(plan.url, plan.step, storage_options=storage_options) as src:
            n = src.fill_ranges(requests)
    except Exception as e:  # whatever a foreign file raises: one line on every rank, no hang
        raise JobError(f"{plan.where}: loading failed: {type(e).__name__}: {e}") from None
    with torch.no_grad():
        for tensor, flat in copies:
            tensor.copy_(flat.view(tensor.shape))
    logger.debug("%s: read %d elements of this rank's shards", plan.where, n)
    return f"initialised from {plan.source}"
