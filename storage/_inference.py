"""Loading a checkpoint into one process for inference: whole tensors, a module, a lazy mapping.

[Note: the model's size in memory]
Tensors are read straight into their final buffers (a module's own parameters when they are real,
new tensors otherwise) in chunks of at most ``chunk`` bytes, so the memory needed is the tensors
asked for plus one chunk of staging, never a second copy of the model. Only the requested tensors
are read: the model weights of a checkpoint that also holds optimizer state cost the weights.
Works for checkpoints of any format and saved at any world size (``storage/_formats.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ftsdp.storage._errors import StateMismatchError
from ftsdp.storage._formats import open_source
from ftsdp.storage._interfaces import Source
from ftsdp.storage._options import LoadOptions
from ftsdp.storage._streaming import MiB, TensorInfo

DEFAULT_CHUNK = 8 * MiB


def _open(
    url: str, step: int | None, storage_options: dict | None, options: LoadOptions | None
) -> Source:
    return open_source(url, None, step, storage_options, io=(options or LoadOptions()).io)


def fill(
    source: Source, targets: list[tuple[str, torch.Tensor]], chunk: int = DEFAULT_CHUNK
) -> None:
    """Fill each contiguous target (any dtype, any device) with the whole source tensor of that name.

    CPU targets of the saved dtype are read into directly; others through one chunk of staging.
    Consecutive small requests share one read.
    """
    jobs: list[tuple[str, int, int, torch.Tensor]] = []  # name, offset, length, target
    for name, target in targets:
        assert target.is_contiguous(), name
        info = source.tensors[name]
        step = max(1, chunk // info.itemsize)
        jobs.extend(
            (name, o, min(step, info.numel - o), target) for o in range(0, info.numel, step)
        )
    group: list[tuple[str, int, int, torch.Tensor]] = []
    used = 0
    for job in jobs:
        size = job[2] * source.tensors[job[0]].itemsize
        if group and used + size > chunk:
            _read_group(source, group)
            group, used = [], 0
        group.append(job)
        used += size
    if group:
        _read_group(source, group)


def _read_group(source: Source, group: list[tuple[str, int, int, torch.Tensor]]) -> None:
    requests, staged = [], []
    for name, off, n, target in group:
        flat = target.detach().view(-1)[off : off + n]
        saved = source.tensors[name].dtype
        if target.device.type == "cpu" and target.dtype == saved:
            requests.append((name, off, flat))  # straight into the final buffer
        else:
            buf = torch.empty(n, dtype=saved)
            requests.append((name, off, buf))
            staged.append((flat, buf))
    source.read_into(requests)
    for flat, buf in staged:
        flat.copy_(buf)


def load_state_dict(
    url: str,
    step: int | None = None,
    keys: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    options: LoadOptions | None = None,
) -> dict[str, torch.Tensor]:
    """Whole tensors ``{dotted name: tensor}`` of a checkpoint, in one process (no process group).

    Any format (ftsdp at any world size, hf, torch, dcp); ``step`` picks an ftsdp step (newest by
    default). Reads only ``keys`` (an unknown key raises ``KeyError``); ``dtype`` casts floating
    tensors; tensors are created on ``device``. Needs the requested tensors' size plus one chunk.
    """
    source = _open(url, step, storage_options, options)
    try:
        names = sorted(source.tensors) if keys is None else list(keys)
        unknown = [n for n in names if n not in source.tensors]
        if unknown:
            where = f"step {source.step} at {url}" if source.step is not None else url
            raise KeyError(f"{where} has no tensor(s) {unknown}")
        out: dict[str, torch.Tensor] = {}
        for n in names:
            info = source.tensors[n]
            cast = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
            out[n] = torch.empty(info.shape, dtype=cast, device=device)
        fill(source, list(out.items()))
        return out
    finally:
        source.close()


@dataclass(frozen=True)
class LoadIntoResult:
    """What ``load_into`` did: the step read and the keys that did not match (module names)."""

    step: int | None
    missing: list[str] = field(default_factory=list)  # in the module, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the module
    still_meta: list[str] = field(default_factory=list)  # module tensors left on the meta device


def load_into(
    module: torch.nn.Module,
    url: str,
    step: int | None = None,
    *,
    prefix: str = "",
    strict: bool = True,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    options: LoadOptions | None = None,
) -> LoadIntoResult:
    """Fill ``module``'s parameters and persistent buffers from checkpoint names ``prefix + key``.

    A module built on the meta device gets new tensors on ``device`` (default: cpu); a real one is
    filled in place (or moved to ``device`` / cast to ``dtype`` when given). Floating tensors take
    ``dtype``, else the module's own dtype. Tied parameters stay tied and are satisfied by any of
    their names. Missing and unexpected keys raise ``StateMismatchError`` before anything is read
    when ``strict``, else are reported in the result; a shape mismatch always raises.
    """
    source = _open(url, step, storage_options, options)
    try:
        groups: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for key, t in module.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(key)
            tensors[id(t)] = t
        saved = {n[len(prefix) :] for n in source.tensors if n.startswith(prefix)}
        known = {k for keys in groups.values() for k in keys}
        missing = sorted(
            k for keys in groups.values() if not saved.intersection(keys) for k in keys
        )
        unexpected = sorted(saved - known)
        plan: list[tuple[int, str]] = []
        bad = []
        for tid, keys in groups.items():
            hit = next((k for k in keys if k in saved), None)
            if hit is None:
                continue
            info: TensorInfo = source.tensors[prefix + hit]
            if tuple(info.shape) != tuple(tensors[tid].shape):
                bad.append(f"{hit} (saved {list(info.shape)}, module {list(tensors[tid].shape)})")
            plan.append((tid, hit))
        if bad or (strict and (missing or unexpected)):
            raise StateMismatchError(
                f"checkpoint {url} (prefix {prefix!r}) does not match the module: missing={missing} "
                f"unexpected={unexpected} shape mismatches={bad}"
                + ("" if bad else " (strict=False loads the rest and reports these)")
            )
        targets: list[tuple[str, torch.Tensor]] = []
        replace: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []
        for tid, hit in plan:
            old = tensors[tid]
            info = source.tensors[prefix + hit]
            want_dtype = dtype if dtype is not None and old.dtype.is_floating_point else old.dtype
            want_device = (
                torch.device(device)
                if device is not None
                else (torch.device("cpu") if old.is_meta else old.device)
            )
            if (
                old.is_meta
                or old.device != want_device
                or old.dtype != want_dtype
                or not old.is_contiguous()
            ):
                new = torch.empty(info.shape, dtype=want_dtype, device=want_device)
                replace.append((groups[tid], old, new))
                targets.append((prefix + hit, new))
            else:
                targets.append((prefix + hit, old))
        fill(source, targets)
        for keys, old, new in replace:
            value = (
                torch.nn.Parameter(new, requires_grad=old.requires_grad)
                if isinstance(old, torch.nn.Parameter)
                else new
            )
            for key in keys:
                owner_name, _, attr = key.rpartition(".")
                owner = module.get_submodule(owner_name)
                table = owner._parameters if attr in owner._parameters else owner._buffers
                table[attr] = value
        still_meta = [
            n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta
        ]
        return LoadIntoResult(source.step, missing, unexpected, still_meta)
    finally:
        source.close()


class LazyStateDict(Mapping):
    """A read-only mapping ``{dotted name: tensor}`` over a checkpoint; a tensor is read on first
    access (and kept unless ``cache=False``). Shapes, dtypes and values need no tensor reads.

    ```python
    with storage.LazyStateDict(url) as ckpt:
        ckpt.info("model.w").shape, ckpt.values["trainer.step"]
        w = ckpt["model.w"]                       # reads this tensor only
        rows = ckpt.read("model.w", 0, 1024)      # a flat range, not cached
    ```
    """

    def __init__(
        self,
        url: str,
        step: int | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        cache: bool = True,
        storage_options: dict[str, Any] | None = None,
        options: LoadOptions | None = None,
    ) -> None:
        self._source = _open(url, step, storage_options, options)
        self.url, self.device, self.dtype, self.cache = url, device, dtype, cache
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def step(self) -> int | None:
        return self._source.step

    @property
    def format(self) -> str:
        return self._source.format

    @property
    def values(self) -> dict[str, Any]:
        """Non-tensor state by dotted name."""
        return dict(self._source.values)

    def info(self, name: str) -> TensorInfo:
        """Shape and dtype of a tensor without reading it."""
        return self._source.tensors[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        info = self._source.tensors[name]  # KeyError for unknown names
        cast = self.dtype if self.dtype is not None and info.dtype.is_floating_point else info.dtype
        t = torch.empty(info.shape, dtype=cast, device=self.device)
        fill(self._source, [(name, t)])
        if self.cache:
            self._cache[name] = t
        return t

    def read(self, name: str, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of the row-major flattening (1-D, saved dtype)."""
        info = self._source.tensors[name]
        if offset < 0 or length < 0 or offset + length > info.numel:
            raise ValueError(
                f"{name}: range offset={offset} length={length} is outside [0, {info.numel})"
            )
        out = torch.empty(length, dtype=info.dtype)
        if length:
            self._source.read_into([(name, offset, out)])
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._source.tensors))

    def __len__(self) -> int:
        return len(self._source.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._source.tensors

    def close(self) -> None:
        """Drop cached tensors and the reader."""
        self._cache.clear()
        self._source.close()

    def __enter__(self) -> LazyStateDict:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
