"""``ftsdp-ckpt convert --to hf``: the trainer's convention (``model.`` names, the
``trainer.model`` record) turned into storage's generic convert options (docs/cli.md, "The
Hugging Face export")."""

from __future__ import annotations

import argparse
import json
import os
import posixpath
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ftsdp import storage

MODEL_PREFIX = "model."
RECORD = "trainer.model"
# The tokenizer's files (every kind transformers writes) and the generation defaults: copied.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "generation_config.json",
)  # fmt: skip
DOCS = "docs/cli.md, 'The Hugging Face export'"


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "a.c": 2}`` -> ``{"a": {"b": 1, "c": 2}}``."""
    out: dict[str, Any] = {}
    for name, value in sorted(flat.items()):
        *parents, leaf = name.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{RECORD}: {name!r} lies under the value {part!r}")
            node = child
        node[leaf] = value
    return out


def read_record(values: Mapping[str, Any], src: str) -> dict[str, Any] | None:
    """The ``trainer.model`` record of a checkpoint's values (whole, as JSON text, or flattened to
    dotted names), with ``hf_config`` parsed; None when there is none. ValueError when it is not
    the documented shape."""
    prefix = RECORD + "."
    flat = {k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)}
    record = values[RECORD] if RECORD in values else _unflatten(flat)
    if record is None or record == {}:
        return None
    try:
        record = json.loads(record) if isinstance(record, str) else record
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        config = record.get("hf_config")
        config = json.loads(config) if isinstance(config, str) else config
        if config is not None and not isinstance(config, dict):
            raise ValueError("hf_config is not a JSON object")
        tokenizer_dir = record.get("tokenizer_dir")
        if tokenizer_dir is not None and not isinstance(tokenizer_dir, str):
            raise ValueError("tokenizer_dir is not a string")
    except ValueError as e:
        raise ValueError(
            f"the model record {RECORD} in {src} is not {{'spec', 'hf_config', 'tokenizer_dir'}} "
            f"({e}); pass --keep-names to convert without it"
        ) from e
    return {**record, "hf_config": config}


# The config keys that count layers: ties do not depend on depth, so the model is built with one.
LAYER_KEYS = (
    "n_layer", "n_layers", "num_layers", "num_hidden_layers", "num_decoder_layers",
    "decoder_layers", "encoder_layers", "num_encoder_layers",
)  # fmt: skip
# Any other integer of a recorded config above this is refused: sizes and counts of real models
# (vocabularies, context lengths of ten million tokens) stay below it.
MAX_CONFIG_INT = 1 << 26


def _one_layer(config: Any, where: str = "hf_config") -> Any:
    """``config`` with each layer count (at any depth) set to 1 and each per-layer list cut to its
    first entry. ValueError naming the key when another integer exceeds ``MAX_CONFIG_INT``."""
    if isinstance(config, list):
        return [_one_layer(v, f"{where}[{i}]") for i, v in enumerate(config)]
    if not isinstance(config, dict):
        if isinstance(config, int) and not -MAX_CONFIG_INT <= config <= MAX_CONFIG_INT:
            raise ValueError(
                f"{where}={config} is beyond +-{MAX_CONFIG_INT}: not a size any model has; fix "
                "the recorded config, or pass --keep-names to export without it"
            )
        return config
    layers = {config[k] for k in LAYER_KEYS if isinstance(config.get(k), int)}
    out = {}
    for key, value in config.items():
        if key in LAYER_KEYS and isinstance(value, int) and not isinstance(value, bool):
            out[key] = 1
        elif isinstance(value, list) and len(value) in layers and len(value) > 1:
            out[key] = _one_layer(value[:1], f"{where}.{key}")  # one entry per layer
        else:
            out[key] = _one_layer(value, f"{where}.{key}")
    return out


def _tied_groups(config: dict[str, Any]) -> list[list[str]]:
    """The names (in module order) of each parameter the model of ``config`` ties, from
    ``transformers`` built on the meta device with one layer (a recorded config is untrusted
    input: its depth would set the time and memory the build takes). ImportError / ValueError
    when it cannot be."""
    import transformers  # here only: the export needs it for tied weights alone (optional)

    rest = {k: v for k, v in _one_layer(config).items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config.get("model_type"), **rest)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _equal(ckpt: storage.LazyStateDict, a: str, b: str, chunk_bytes: int) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same bytes, compared a chunk at a time."""
    ia, ib = ckpt.info(a), ckpt.info(b)
    if ia.shape != ib.shape or ia.dtype != ib.dtype:
        return False
    step = max(1, chunk_bytes // max(1, ia.dtype.itemsize))
    for offset in range(0, ia.numel, step):
        n = min(step, ia.numel - offset)
        if not torch.equal(ckpt.read(a, offset, n), ckpt.read(b, offset, n)):
            return False
    return True


def tied_copies(
    ckpt: storage.LazyStateDict, config: dict[str, Any], chunk_bytes: int
) -> tuple[list[str], list[str]]:
    """The names holding a copy of a tied parameter saved under an earlier name (left out), and
    notes; looked up only when two model tensors of one shape with ``vocab_size`` in it could be
    tied word embeddings (a tied weight saved once, as ``ftsdp.FSDP`` does, costs nothing)."""
    if not config.get("tie_word_embeddings"):
        return [], []
    vocab = config.get("vocab_size")
    shapes = Counter(tuple(ckpt.info(n).shape) for n in ckpt if n.startswith(MODEL_PREFIX))
    if max((k for shape, k in shapes.items() if vocab in shape), default=0) < 2:
        return [], []
    try:
        groups = _tied_groups(config)
    except Exception as e:  # transformers missing, or a model it cannot build from the config
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        return [], [
            f"tied weights not looked up ({why}): every model tensor is written, a tied one "
            "under each of its names (from_pretrained loads them)"
        ]
    drop: list[str] = []
    notes: list[str] = []
    for group in groups:
        present = [MODEL_PREFIX + n for n in group if MODEL_PREFIX + n in ckpt]
        for copy in present[1:]:
            if _equal(ckpt, present[0], copy, chunk_bytes):
                drop.append(copy)
            else:
                notes.append(
                    f"{copy} differs from {present[0]}, which the model ties it to: both written"
                )
    return drop, notes


def _local(url: str) -> str | None:
    """The local path a URL names; None for a remote one (no links there)."""
    if "://" not in url:
        return url
    return url.removeprefix("file://") if url.startswith("file://") else None


def _link_root(folder: str) -> str:
    """Where links in ``folder`` may lead: the folder itself, or for a Hugging Face cache snapshot
    (``models--ORG--NAME/snapshots/REV``, whose files link to ``../../blobs/``) its repository."""
    real = os.path.realpath(folder)
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return repo
    return real


def _tokenizer_files(folder: str, root: str | None) -> dict[str, str]:
    """``{name: where it is read from}`` of the tokenizer files in ``folder``. On a local disk
    each must resolve (links followed) inside ``root``: ValueError naming the file otherwise."""
    path = _local(folder)
    if path is None or root is None:  # a remote store has no links
        return {name: f"{folder.rstrip('/')}/{name}" for name in TOKENIZER_FILES}
    found = {}
    for name in TOKENIZER_FILES:
        file = os.path.join(path, name)
        if not os.path.lexists(file):
            continue
        real = os.path.realpath(file)
        if os.path.commonpath([root, real]) != root:
            raise ValueError(
                f"tokenizer file {file} leads to {real}, outside {root}: refused (a link may only "
                "stay inside the folder, or inside a Hugging Face cache's models--* folder); copy "
                "the file into the folder, or pass --tokenizer with another folder"
            )
        if os.path.isfile(real):
            found[name] = file if real == os.path.abspath(file) else f"{file} (a link to {real})"
    return found


def tokenizer_source(
    src: str, named: str | None, recorded: str | None
) -> tuple[str | None, dict[str, str], list[str]]:
    """(folder, ``{name: where from}``, notes) of the tokenizer files an export copies: from the
    folder the user names (``--tokenizer``), else from the recorded ``tokenizer_dir`` only when
    it lies inside the checkpoint's own root (resolved against that root): a checkpoint from
    elsewhere must not make the export copy a file of this machine into its output."""
    if named:
        path = _local(named)
        return named, _tokenizer_files(named, path and _link_root(path)), []
    if not recorded:
        return None, {}, []
    root = _local(src)
    if root is not None:
        root = os.path.realpath(root)
        inside = os.path.realpath(os.path.join(root, recorded))
        folder: str | None = inside if os.path.commonpath([root, inside]) == root else None
    else:  # remote: a relative path without ".." stays inside
        rel = posixpath.normpath(recorded)
        folder = None if rel.startswith(("/", "..")) else f"{src.rstrip('/')}/{rel}"
    if folder is None:
        note = (
            f"tokenizer files not copied: the checkpoint records tokenizer_dir {recorded}, "
            "outside the checkpoint; pass --tokenizer DIR to copy them from a folder you trust"
        )
        return None, {}, [note]
    return folder, _tokenizer_files(folder, root), []


MAX_CONFIG_BYTES = 1 << 20  # a config.json read from a source folder: far more than any model's


def _config_json(config: Any, dtype: str | None) -> bytes:
    """``config`` as config.json's text, its dtype set to ``dtype`` as save_pretrained sets it."""
    if dtype is not None and isinstance(config, dict):
        config = {**config, "dtype": dtype}
        if "torch_dtype" in config:  # the older key
            config["torch_dtype"] = dtype
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _as_named(
    args: argparse.Namespace, fmt: str, step: int | None
) -> tuple[dict[str, Any], Callable[[Any], list[str]]]:
    """The export of a checkpoint that is not a training checkpoint (a Hugging Face folder, or a
    model's own state dict saved in another format): every tensor under the name it has (but the
    optimizer's, without ``--include-optimizer``); from a Hugging Face folder, its config.json
    (its dtype set to the weights') and tokenizer files come along."""
    kwargs: dict[str, Any] = {"model_only": not args.include_optimizer, "step": step}
    what = "a Hugging Face folder" if fmt == "hf" else f"not a training checkpoint ({DOCS})"
    notes = [f"note: {args.src} is {what}: wrote every tensor under its own name"]
    path = _local(args.src)
    if (
        fmt != "hf"
        or args.dst.rstrip("/").endswith(".safetensors")
        or (path is not None and not os.path.isdir(path))
    ):
        return kwargs, lambda r: notes
    config = _source_config(args.src, args.storage_options)
    if config is not None:
        dtype = str(args.dtype).removeprefix("torch.") if args.dtype else None
        kwargs["extra_files"] = {"config.json": _config_json(config, dtype)}
    folder, files, _ = tokenizer_source(args.src, args.tokenizer or args.src, None)
    if files:
        kwargs.update(copy_files=list(files), copy_files_from=folder)

    def lines(result: Any) -> list[str]:
        copied = [f"copied {name} from {files[name]}" for name in result.extra if name in files]
        return [
            *(["wrote config.json from the source's"] if config is not None else []),
            *copied,
            *notes,
        ]

    return kwargs, lines


def _source_config(folder: str, storage_options: dict[str, Any] | None) -> Any:
    """The JSON of ``folder``'s config.json; None when it has none. ValueError when it is larger
    than ``MAX_CONFIG_BYTES`` or not JSON."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(folder, **(storage_options or {}))
    path = f"{root.rstrip('/')}/config.json"
    if not fs.isfile(path):
        return None
    data = fs.cat_file(path, start=0, end=MAX_CONFIG_BYTES + 1)  # never more, whatever it says
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{folder}/config.json is larger than {MAX_CONFIG_BYTES} bytes: refused")
    try:
        return json.loads(data)
    except ValueError as e:
        raise ValueError(f"{folder}/config.json is not JSON ({e}); pass --keep-names") from e


def hf_export(args: argparse.Namespace) -> tuple[dict[str, Any], Callable[[Any], list[str]]]:
    """``storage.conversion.convert`` keyword arguments for ``convert --to hf``, and a function
    giving the lines to print on its result (each tokenizer file copied and where from; notes)."""
    if args.keep_names:  # the names as saved, nothing added
        return {"model_only": args.model_only or not args.include_optimizer}, lambda r: []
    with storage.LazyStateDict(
        args.src, args.step, storage_options=args.storage_options, trust_pickle=args.trust_pickle
    ) as ckpt:
        if not storage.conversion.training_layout(ckpt.format, ckpt):  # a model's own names
            return _as_named(args, ckpt.format, ckpt.step)
        record = read_record(ckpt.values, args.src)
        # the exported floating weights' dtype name (None when they mix dtypes)
        kinds = {ckpt.info(n).dtype for n in ckpt if n.startswith(MODEL_PREFIX)}
        kinds = {k for k in ({args.dtype} if args.dtype else kinds) if k.is_floating_point}
        dtype = str(kinds.pop()).removeprefix("torch.") if len(kinds) == 1 else None
        step = ckpt.step  # pinned: a job committing meanwhile does not change what is exported
        config = record and record.get("hf_config")
        tied, tie_notes = tied_copies(ckpt, config, args.max_memory // 8) if config else ([], [])
    kwargs: dict[str, Any] = {
        "model_only": not args.include_optimizer,
        "strip_prefix": MODEL_PREFIX,
        "step": step if args.step is None else args.step,
        "exclude": tied,
    }
    if not config:
        note = (
            f"note: {args.src} records no Hugging Face config ({RECORD}.hf_config): wrote the "
            f"weights without the '{MODEL_PREFIX}' prefix and no config.json ({DOCS})"
        )
        return kwargs, lambda r: [note]
    notes = [f"note: {n}" for n in tie_notes]
    if args.dst.rstrip("/").endswith(".safetensors"):  # one file
        note = f"note: {args.dst} is one file: config.json and tokenizer files not written ({DOCS})"
        return kwargs, lambda r: [*notes, note]
    kwargs["extra_files"] = {"config.json": _config_json(config, dtype)}
    assert record is not None  # config came from it
    folder, files, tokenizer_notes = tokenizer_source(
        args.src, args.tokenizer, record.get("tokenizer_dir")
    )
    notes += [f"note: {n}" for n in tokenizer_notes]
    if files:
        kwargs.update(copy_files=list(files), copy_files_from=folder)

    def lines(result: Any) -> list[str]:
        copied = [f"copied {name} from {files[name]}" for name in result.extra if name in files]
        missing = [
            f"note: no tokenizer files copied: {folder} is not there or holds none of the "
            f"known tokenizer files; copy them into {args.dst} yourself"
        ]
        return [*copied, *notes, *(missing if folder and not copied else [])]

    return kwargs, lines
