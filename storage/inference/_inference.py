"""Loading a checkpoint into one process for inference: whole tensors, a module, a lazy mapping
(docs/cli.md, "Python API for inference"). [Note: the cast rule]: a saved dtype becomes the
target implicitly only when every saved value is one of the target's (``_cast_ok``; "Casts")."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch

from ftsdp.storage._errors import StateMismatchError
from ftsdp.storage._options import LoadOptions
from ftsdp.storage.conversion._formats import open_source
from ftsdp.storage.conversion._interfaces import Source
from ftsdp.storage.format._ranges import Range, check_range
from ftsdp.storage.io._buffers import empty_in_huge_pages
from ftsdp.storage.io._streaming import MiB, TensorInfo, group_requests, split_request

logger = logging.getLogger(__name__)

DEFAULT_CHUNK = 8 * MiB


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def _cast_ok(saved: torch.dtype, target: torch.dtype) -> bool:
    """Whether every value of ``saved`` is a value of ``target`` ([Note: the cast rule])."""
    if saved == target:
        return True
    kind = _kind(saved)
    if kind != _kind(target) or kind == "bool":
        return False
    if kind == "int":
        s, t = torch.iinfo(saved), torch.iinfo(target)
        return t.min <= s.min and t.max >= s.max
    f, g = torch.finfo(saved), torch.finfo(target)  # of the parts, for complex
    return g.max >= f.max and g.eps <= f.eps and g.smallest_normal <= f.smallest_normal


def _target_dtype(dtype: torch.dtype | None, current: torch.dtype) -> tuple[torch.dtype, bool]:
    """(target dtype, asked for): ``dtype`` for tensors of its kind, else ``current``."""
    if dtype is not None and _kind(dtype) == _kind(current):
        return dtype, True
    return current, False


def _empty(info: TensorInfo, dtype: torch.dtype | None, device: str | torch.device) -> torch.Tensor:
    """A new tensor for ``info`` on ``device``, cast only to a ``dtype`` of its kind."""
    want = _target_dtype(dtype, info.dtype)[0]
    if torch.device(device).type == "cpu":
        return empty_in_huge_pages(tuple(info.shape), want)
    return torch.empty(info.shape, dtype=want, device=device)


def _check_casts(where: str, casts: list[tuple[str, torch.dtype, torch.dtype, bool]]) -> None:
    """StateMismatchError for the ``(name, saved, target, explicit)`` casts refused."""
    refused = [(n, s, t) for n, s, t, explicit in casts if not explicit and not _cast_ok(s, t)]
    if refused:
        listed = ", ".join(f"{n!r} (saved {s}, target {t})" for n, s, t in refused[:10])
        more = f" and {len(refused) - 10} more" if len(refused) > 10 else ""
        asks = " or ".join(f"dtype={t}" for t in sorted({str(t) for _, _, t in refused}))
        raise StateMismatchError(
            f"{where}: refusing to cast {listed}{more}: a cast across kinds (float, int, bool, "
            f"complex) or to a narrower dtype happens only when asked for; pass {asks} (it applies "
            "to the tensors of its kind) to cast explicitly"
        )


def fill(
    source: Source, targets: list[tuple[str, torch.Tensor | None]], chunk: int = DEFAULT_CHUNK
) -> None:
    """Fill each contiguous target (any dtype, any device) with the whole source tensor of that
    name: CPU targets of the saved dtype directly, others through one chunk of staging. A target of
    None is read (and verified) but not kept."""
    by_name = dict(targets)
    assert all(t is None or t.is_contiguous() for t in by_name.values()), list(by_name)
    sizes = {n: source.tensors[n].itemsize for n in by_name}
    requests = [
        r for n in by_name for r in split_request(n, 0, source.tensors[n].numel, sizes[n], chunk)
    ]
    scratch = _Scratch(chunk)
    for group in group_requests(requests, sizes, chunk):
        reads, staged = [], []
        scratch.pos = 0  # the previous group's staging is copied out: reuse it
        for r in group:
            saved, target = source.tensors[r.name].dtype, by_name[r.name]
            if target is not None and target.device.type == "cpu" and target.dtype == saved:
                flat = target.detach().view(-1)[r.offset : r.offset + r.length]
                reads.append((r.name, r.offset, flat))  # straight into the final buffer
                continue
            buf = scratch.take(r.length, saved)  # staged, or only verified (no target)
            reads.append((r.name, r.offset, buf))
            if target is not None:
                staged.append((target.detach().view(-1)[r.offset : r.offset + r.length], buf))
        source.read_into(reads)
        for flat, buf in staged:
            flat.copy_(buf)


class _Scratch:
    """One buffer of ``chunk`` bytes every group of a ``fill`` stages into in turn (a buffer per
    group, freed and allocated again, grew glibc's arenas by a few chunks)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.pos = nbytes, 0
        self.buf: torch.Tensor | None = None  # allocated on first use

    def take(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``n`` elements of ``dtype``: from the buffer while it has room, else fresh."""
        size = dtype.itemsize
        start = -(-self.pos // 16) * 16  # aligned for any dtype
        if start + n * size > self.nbytes:
            return torch.empty(n, dtype=dtype)
        if self.buf is None:
            self.buf = torch.empty(self.nbytes, dtype=torch.uint8)
        self.pos = start + n * size
        return self.buf[start : self.pos].view(dtype)


def _copy_in(dst: torch.Tensor, src: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> None:
    """Copy ``src`` (CPU) into ``dst`` (any dtype and device) a chunk at a time."""
    if not dst.is_contiguous():  # a strided target (a channels_last weight): one copy
        dst.detach().copy_(src.view(dst.shape))
        return
    d, s = dst.detach().view(-1), src.view(-1)
    step = max(1, chunk // max(d.element_size(), s.element_size()))
    for a in range(0, d.numel(), step):
        d[a : a + step].copy_(s[a : a + step])


def _open(
    url: str,
    step: int | None,
    storage_options: dict[str, Any] | None,
    options: LoadOptions | None,
    trust_pickle: bool,
) -> Source:
    """The loaders' source of ``url``: what it holds that no loader can represent (a dtype torch or
    the format lacks, a value that is not JSON) is named in a warning, not dropped unsaid."""
    source = open_source(
        url, None, step, storage_options, options=options, trust_pickle=trust_pickle
    )
    if source.dropped:
        logger.warning(
            "%s: %d entr%s left out, not loadable here: %s",
            *(url, len(source.dropped), "y" if len(source.dropped) == 1 else "ies"),
            "; ".join(source.dropped_list()),
        )
    return source


def _unknown(source: Source, where: str, names: Sequence[str]) -> KeyError:
    """The KeyError for tensor ``names`` ``source`` does not give: those it holds in a form no
    loader represents are named with why, apart from those it does not hold."""
    left_out = [f"{n} ({source.dropped[n]})" for n in names if n in source.dropped]
    absent = [n for n in names if n not in source.dropped]
    parts = [f"has no tensor(s) {absent}"] if absent else []
    if left_out:
        parts.append(f"holds, but cannot load: {'; '.join(left_out)}")
    return KeyError(f"{where} {' and '.join(parts)}")


def load_state_dict(
    url: str,
    step: int | None = None,
    keys: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    options: LoadOptions | None = None,
    trust_pickle: bool = False,
) -> dict[str, torch.Tensor]:
    """Whole tensors ``{dotted name: tensor}`` of a checkpoint of any format, in one process.

    ``step`` picks an ftsdp step (newest by default); only ``keys`` are read (one name or
    several; ``KeyError`` for an unknown one); ``dtype`` casts the tensors of its kind, the
    others keep their saved dtype; tensors are created on ``device``."""
    if isinstance(keys, str):  # one name, not its characters
        keys = [keys]
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} must be a torch.dtype (e.g. torch.bfloat16) or None")
    with closing(_open(url, step, storage_options, options, trust_pickle)) as source:
        names = sorted(source.tensors) if keys is None else list(keys)
        unknown = [n for n in names if n not in source.tensors]
        if unknown:
            where = f"step {source.step} at {url}" if source.step is not None else url
            raise _unknown(source, where, unknown)
        out = {n: _empty(source.tensors[n], dtype, device) for n in names}
        fill(source, list(out.items()))
        return out


@dataclass(frozen=True)
class LoadIntoResult:
    """What ``load_into`` did: the step read and the keys that did not match (module names)."""

    step: int | None
    missing: list[str] = field(default_factory=list)  # in the module, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the module
    still_meta: list[str] = field(default_factory=list)  # module tensors left on the meta device
    staged_bytes: int = 0  # staging held on top of the module's tensors


_EXTRA_STATE = "_extra_state"  # the state_dict key of a module's get_extra_state()


def load_into(
    module: torch.nn.Module,
    url: str,
    step: int | None = None,
    *,
    prefix: str = "",
    strict: bool = True,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    max_staging_bytes: int | None = None,
    storage_options: dict[str, Any] | None = None,
    options: LoadOptions | None = None,
    trust_pickle: bool = False,
) -> LoadIntoResult:
    """Fill ``module``'s parameters and persistent buffers from checkpoint names ``prefix + key``;
    a submodule's extra state saved under its ``..._extra_state`` name, a tensor or one value (of
    an ftsdp checkpoint), is handed to its ``set_extra_state``, as ``Module.load_state_dict``
    does (a dict, which a save flattens into several names, is reported missing).

    A meta module gets new tensors on ``device`` (default: cpu); a real one is filled in place (or
    moved to ``device`` / cast to ``dtype`` when given). ``dtype`` applies to the tensors of its
    kind; the others keep the module's dtype ([Note: the cast rule]). Tied parameters stay tied;
    saved under several of their names, they take the last one's values, as torch does. All or
    nothing: the module is written only after every byte it gets was read and verified, staged on
    the CPU (``staged_bytes``) or, past ``max_staging_bytes``, read twice (docs/cli.md, "Python
    API for inference").

    Raises ``StateMismatchError`` before anything is read for a shape mismatch, a refused cast,
    or, when ``strict``, missing and unexpected keys (else reported in the result)."""
    with closing(_open(url, step, storage_options, options, trust_pickle)) as source:
        groups: dict[int, list[str]] = {}
        tensors: dict[int, torch.Tensor] = {}
        extra: list[str] = []  # keys of modules' extra state (get_extra_state)
        for key, t in module.state_dict(keep_vars=True).items():
            if key.rpartition(".")[2] == _EXTRA_STATE:
                extra.append(key)
                continue
            groups.setdefault(id(t), []).append(key)
            tensors[id(t)] = t
        saved = {n[len(prefix) :] for n in source.tensors if n.startswith(prefix)}
        extra_saved = [k for k in extra if k in saved or prefix + k in source.values]
        missing = sorted(
            [k for keys in groups.values() if not saved.intersection(keys) for k in keys]
            + [k for k in extra if k not in extra_saved]
        )
        unexpected = sorted(saved - {k for keys in groups.values() for k in keys} - set(extra))
        plan: list[tuple[int, str, torch.dtype, torch.dtype, bool]] = []  # tid, name, the cast
        bad = []
        for tid, keys in groups.items():
            # of a tied tensor's names saved, the last (torch's load_state_dict copies each in
            # order, so the last copy wins there too)
            hit = next((k for k in reversed(keys) if k in saved), None)
            if hit is None:
                continue
            info: TensorInfo = source.tensors[prefix + hit]
            if tuple(info.shape) != tuple(tensors[tid].shape):
                bad.append(f"{hit} (saved {list(info.shape)}, module {list(tensors[tid].shape)})")
            want_dtype, explicit = _target_dtype(dtype, tensors[tid].dtype)
            plan.append((tid, prefix + hit, info.dtype, want_dtype, explicit))
        if bad or (strict and (missing or unexpected)):
            raise StateMismatchError(
                f"checkpoint {url} (prefix {prefix!r}) does not match the module: missing={missing} "
                f"unexpected={unexpected} shape mismatches={bad}"
                + ("" if bad else " (strict=False loads the rest and reports these)")
                + "".join(
                    f"; {k} is in it but cannot be loaded ({source.dropped[prefix + k]})"
                    for k in missing
                    if prefix + k in source.dropped
                )
            )
        _check_casts(f"checkpoint {url} (prefix {prefix!r})", [p[1:] for p in plan])
        # Phase one reads and verifies; nothing of the module is written.
        reads: list[tuple[str, torch.Tensor | None]] = []  # new tensors: the result
        extra_states: list[tuple[str, Any]] = []  # (module key, its saved extra state)
        for key in extra_saved:
            if key in saved:  # a tensor, read like the others
                info = source.tensors[prefix + key]
                state = torch.empty(info.shape, dtype=info.dtype, device=device or "cpu")
                reads.append((prefix + key, state))
                extra_states.append((key, state))
            else:
                extra_states.append((key, source.values[prefix + key]))
        replace: list[tuple[list[str], torch.Tensor, torch.Tensor]] = []
        in_place: list[tuple[str, torch.Tensor, torch.dtype]] = []  # (name, tensor, staging dtype)
        for tid, name, saved_dtype, want_dtype, _ in plan:
            old = tensors[tid]
            want_device = torch.device(device or ("cpu" if old.is_meta else old.device))
            moved = old.is_meta or old.device != want_device or old.dtype != want_dtype
            if moved:  # (a strided tensor is filled in place too, as torch's load_state_dict)
                new = torch.empty(old.shape, dtype=want_dtype, device=want_device)
                replace.append((groups[tid], old, new))
                reads.append((name, new))
            else:
                narrower = min(saved_dtype, old.dtype, key=lambda d: d.itemsize)
                in_place.append((name, old, narrower))
        staged_bytes = sum(t.numel() * d.itemsize for _, t, d in in_place)
        if max_staging_bytes is None or staged_bytes <= max_staging_bytes:
            staging = [torch.empty(t.shape, dtype=d) for _, t, d in in_place]
            fill(source, reads + [(n, b) for (n, _, _), b in zip(in_place, staging, strict=True)])
            # Phase two writes the module.
            for (_, t, _), buf in zip(in_place, staging, strict=True):
                _copy_in(t, buf)
            del staging
        else:  # over the bound: verify only, then read again straight into the module
            staged_bytes = 0
            fill(source, reads + [(name, None) for name, _, _ in in_place])
            try:
                fill(source, [(name, t) for name, t, _ in in_place if t.is_contiguous()])
                for name, t, narrower in in_place:
                    if not t.is_contiguous():  # a strided one through a staging tensor of its own
                        buf = torch.empty(t.shape, dtype=narrower)
                        staged_bytes = max(staged_bytes, buf.numel() * buf.element_size())
                        fill(source, [(name, buf)])
                        _copy_in(t, buf)
            except Exception as e:
                note = (
                    f"load_into: every byte of {url} had been read and verified once, so the "
                    "checkpoint changed or became unreadable since; the module is partly "
                    "overwritten: load it again"
                )
                if sys.version_info >= (3, 11):
                    e.add_note(note)
                else:  # exceptions have no notes before Python 3.11: the log says it
                    logger.error(note)
                raise
        for key, state in extra_states:  # as Module.load_state_dict hands it back
            module.get_submodule(key.rpartition(".")[0]).set_extra_state(state)
        for keys, old, new in replace:
            value = new
            if isinstance(old, torch.nn.Parameter):
                value = torch.nn.Parameter(new, requires_grad=old.requires_grad)
            for key in keys:  # a Parameter exactly where the old value was one
                owner_name, _, attr = key.rpartition(".")
                setattr(module.get_submodule(owner_name), attr, value)
        still_meta = [
            n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta
        ]
        return LoadIntoResult(source.step, missing, unexpected, still_meta, staged_bytes)


class LazyStateDict(Mapping):
    """A read-only mapping ``{dotted name: tensor}`` over a checkpoint; a tensor is read on first
    access (kept unless ``cache=False``); ``info`` and ``values`` read no tensor. ``dtype`` casts as
    in ``load_state_dict``; ``read(name, offset, length)`` gives a flat range, saved dtype.

    Threads may share one: ``[]``, ``read`` and ``fill_ranges`` may be called from several at once.
    A local hf or torch file replaced or rewritten since it was opened raises
    ``CorruptCheckpointError`` naming it when read. A forked child may read a local one; one on S3
    used before the fork must be opened again there (docs/cli.md, "Python API for inference")."""

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
        trust_pickle: bool = False,
    ) -> None:
        self._source = _open(url, step, storage_options, options, trust_pickle)
        self.url, self.device, self.dtype, self.cache = url, device, dtype, cache
        self._cache: dict[str, torch.Tensor] = {}
        self._closed = False
        self._lock = threading.Lock()  # close() against a read storing into the cache

    def _open_source(self) -> Source:
        """The reader, unless ``close()`` was called: reading then raises, as a closed file
        does (the reader would quietly open its files again)."""
        if self._closed:
            raise ValueError(f"LazyStateDict of {self.url} is closed: open it again to read")
        return self._source

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Around one read (the caller took the reader already): a read that ``close()``
        overtook raises the closed error (whatever the reader raised meanwhile), before anything
        is kept or written."""
        try:
            yield
        finally:
            self._open_source()

    @property
    def step(self) -> int | None:
        return self._source.step

    @property
    def format(self) -> str:
        return self._source.format

    # shadows Mapping.values() (the tensors): LazyStateDict.values() raises TypeError
    @property
    def values(self) -> dict[str, Any]:  # type: ignore[override]
        """Non-tensor state by dotted name."""
        return dict(self._source.values)

    def info(self, name: str) -> TensorInfo:
        """Shape and dtype of a tensor without reading it."""
        return self._source.tensors[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self._open_source()  # closed: raises, cached or not
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        if name not in source.tensors:
            raise _unknown(source, self.url, [name])
        t = _empty(source.tensors[name], self.dtype, self.device)
        with self._reading():
            fill(source, [(name, t)])
        if self.cache:
            with self._lock:  # not into the cache close() cleared
                self._open_source()
                t = self._cache.setdefault(name, t)  # a thread that read it too keeps the first
        return t

    def read(self, name: str, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of the row-major flattening (1-D, saved dtype)."""
        source = self._open_source()
        info = source.tensors[name]
        check_range(Range(offset, length), info.numel, name)
        out = torch.empty(length, dtype=info.dtype)
        if length:
            with self._reading():
                source.read_into([(name, offset, out)])
        return out

    def fill_ranges(
        self, targets: Sequence[tuple[str, int, torch.Tensor]], chunk: int = DEFAULT_CHUNK
    ) -> int:
        """Fill each ``(name, offset, out)``: ``out`` (1-D, contiguous, any dtype and device) gets
        elements ``[offset, offset + out.numel())`` of the row-major flattening of tensor
        ``name``, reading only those ranges; returns the number of elements read.

        All or nothing: every range is read (and verified, where the format has checksums) into
        CPU staging of the saved dtype, ``chunk`` bytes of requests at a time, before any ``out``
        is written. ``KeyError`` for an unknown name, ``ValueError`` for a range outside
        its tensor, ``StateMismatchError`` for a cast refused by [Note: the cast rule], all
        before anything is read."""
        source = self._open_source()
        unknown = [n for n, _, _ in targets if n not in source.tensors]
        if unknown:
            raise _unknown(source, self.url, sorted(set(unknown)))
        for name, offset, out in targets:
            if out.dim() != 1 or not out.is_contiguous():
                raise ValueError(f"{name}: the target must be 1-D and contiguous")
            check_range(Range(offset, out.numel()), source.tensors[name].numel, name)
        _check_casts(
            f"checkpoint {self.url}",
            [(n, source.tensors[n].dtype, out.dtype, False) for n, _, out in targets],
        )
        # Phase one: read everything into staging of the saved dtypes (an allowed cast only
        # widens: the narrower of the two, as load_into stages); nothing of the targets is
        # written. Requests go in groups of at most a chunk (the ftsdp reader holds a group).
        staging = [torch.empty(out.numel(), dtype=source.tensors[n].dtype) for n, _, out in targets]
        pieces = [
            (r, stage[r.offset - offset : r.offset - offset + r.length])
            for (name, offset, _), stage in zip(targets, staging, strict=True)
            for r in split_request(name, offset, stage.numel(), stage.element_size(), chunk)
        ]
        views = iter(view for _, view in pieces)  # group_requests keeps the order
        sizes = {n: source.tensors[n].itemsize for n, _, _ in targets}
        with self._reading():
            for group in group_requests([r for r, _ in pieces], sizes, chunk):
                source.read_into([(r.name, r.offset, next(views)) for r in group])
        # Phase two: write the targets.
        for (_, _, out), stage in zip(targets, staging, strict=True):
            _copy_in(out, stage)
        return sum(stage.numel() for stage in staging)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._source.tensors))

    def __len__(self) -> int:
        return len(self._source.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._source.tensors

    def close(self) -> None:
        """Drop cached tensors and the reader; reading a tensor afterwards raises
        ``ValueError`` (the names, ``info`` and ``values`` stay), and so does a read that was
        in flight, which keeps nothing. Closing twice is fine."""
        with self._lock:
            self._closed = True
            self._cache.clear()
        self._source.close()

    def __enter__(self) -> LazyStateDict:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
