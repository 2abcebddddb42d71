"""The format table: each format's source, sink and detector; no other code chooses what to run
by a format's name. The dcp row imports ``_dcp.py`` (and DCP) only when it is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from ftsdp.storage._errors import CheckpointError, CheckpointNotFoundError
from ftsdp.storage._options import LoadOptions
from ftsdp.storage.conversion._interfaces import Sink, Source
from ftsdp.storage.conversion._sinks import FtsdpSink, HfSink, TorchSink
from ftsdp.storage.conversion._sources import FtsdpSource, HfSource, TorchSource
from ftsdp.storage.format._layout import DCP_METADATA, HF_INDEX, LATEST, MANIFEST, parse_step
from ftsdp.storage.format._manifest import read_manifest_file
from ftsdp.storage.io._fs import Store

_ZIP_MAGIC = b"PK\x03\x04"  # a torch.save file is a zip file


@dataclass(frozen=True)
class Probe:
    """What the detectors look at: a directory's listing, or a file's first bytes."""

    url: str
    is_file: bool
    names: frozenset[str]  # a directory's entries (empty for a file)
    magic: bytes  # a file's first 4 bytes (empty for a directory)
    dirs: frozenset[str] = frozenset()  # the entries that are directories (key prefixes)


@dataclass(frozen=True)
class SinkOptions:
    """What a conversion asks of its destination; each sink takes what applies to its format."""

    world_size: int | None
    max_shard_bytes: int | None
    object_bytes: int
    overwrite: bool = False  # replace what is there (see [Note: a sink deletes only what it wrote])
    extra: tuple = ()  # (plain name, produce) of files beside an hf folder's tensors (HfSink)
    mesh: tuple[int, ...] | None = None  # ftsdp: laid out as the ranks of this mesh (_mesh.py)
    placements: tuple = ()  # ftsdp with a mesh: (fnmatch pattern, placements) rules


@dataclass(frozen=True)
class Format:
    """A row of the table: how to open, write and recognise a checkpoint of this format."""

    name: str
    # (store, step, chunk, trust_pickle, options)
    open: Callable[[Store, int | None, int, bool, LoadOptions], Source]
    sink: Callable[[Store, SinkOptions], Sink]
    detect: Callable[[Probe], bool]
    steps: bool = False  # a checkpoint holds several steps (``step`` picks one)


def _dcp() -> ModuleType:
    """``_dcp.py``, imported when first used."""
    return importlib.import_module("ftsdp.storage.conversion._dcp")


_TABLE = {
    f.name: f
    for f in (
        Format(
            "ftsdp",
            open=lambda store, step, chunk, trust, options: FtsdpSource(store, step, options),
            sink=lambda store, o: FtsdpSink(
                store, o.world_size or 1, o.object_bytes, o.mesh, o.placements
            ),
            detect=lambda p: (  # latest or a step-<N> directory, whatever else it holds
                not p.is_file
                and (LATEST in p.names or any(parse_step(n) is not None for n in p.dirs))
            ),
            steps=True,
        ),
        Format(
            "hf",
            open=lambda store, step, chunk, trust, options: HfSource(store),
            sink=lambda store, o: HfSink(store, o.max_shard_bytes, o.overwrite, o.extra),
            detect=lambda p: (
                p.url.endswith(".safetensors")
                if p.is_file
                else HF_INDEX in p.names or any(n.endswith(".safetensors") for n in p.names)
            ),
        ),
        Format(
            "torch",
            open=lambda store, step, chunk, trust, options: TorchSource(store),
            sink=lambda store, o: TorchSink(store),
            detect=lambda p: p.is_file and p.magic == _ZIP_MAGIC,
        ),
        Format(
            "dcp",
            open=lambda store, step, chunk, trust, options: _dcp().DcpSource(store, chunk, trust),
            sink=lambda store, o: _dcp().DcpSink(store, o.overwrite),
            detect=lambda p: not p.is_file and DCP_METADATA in p.names,
        ),
    )
}
FORMATS = tuple(_TABLE)
# The first format whose detector accepts wins: a torch zip file named .safetensors is torch; a
# directory with step dirs or ``latest`` is an ftsdp root whatever else it holds (its .metadata
# is never read); then DCP's .metadata; hf, the loosest test, is last.
_DETECTION_ORDER = ("torch", "ftsdp", "dcp", "hf")


def get_format(name: str) -> Format:
    """The table's row of ``name``; ValueError for an unknown format."""
    if name not in _TABLE:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return _TABLE[name]


def detect_format(url: str, storage_options: dict | None = None) -> str:
    """``ftsdp``, ``hf``, ``torch`` or ``dcp`` for what lies at ``url`` (ValueError when none)."""
    store = Store(url, storage_options)
    if not store.exists():
        raise CheckpointNotFoundError(f"no checkpoint at {url}: it does not exist")
    if store.isfile():
        head = store.read_range("", 0, 4) if store.size() >= 4 else b""
        probe = Probe(store.url, True, frozenset(), head)
    else:
        listing = store.listdir()
        dirs = frozenset(n for n, (kind, _) in listing.items() if kind == "directory")
        probe = Probe(store.url, False, frozenset(listing), b"", dirs)
    if MANIFEST in probe.names:
        # A step directory: its objects are safetensors files, but reading them as hf would skip
        # the manifest and its checksums (someone else's manifest.json is no step's).
        try:
            read_manifest_file(store, MANIFEST)
        except CheckpointError:
            pass
        else:
            raise ValueError(
                f"{url} is a step directory of an ftsdp checkpoint; pass its parent (the "
                "checkpoint root) and the step (step=N, --step N)"
            )
    for name in _DETECTION_ORDER:
        if _TABLE[name].detect(probe):
            return name
    if probe.is_file:
        raise ValueError(
            f"cannot tell the format of the file {url}: not a torch.save zip file nor .safetensors "
            "(legacy non-zip torch files are not supported; re-save them with torch.save)"
        )
    raise ValueError(
        f"no checkpoint found at {url}: expected step-<N>/ dirs (ftsdp), .metadata (dcp), "
        "*.safetensors (hf) or a torch.save file"
    )


def open_source(
    url: str,
    fmt: str | None = None,
    step: int | None = None,
    storage_options: dict | None = None,
    chunk: int = 32 << 20,
    options: LoadOptions | None = None,
    trust_pickle: bool = False,
) -> Source:
    """Open ``url`` as format ``fmt`` (None: detected); ``step`` for formats with steps; ``chunk``
    bounds what a source reading whole items holds; ``options``: I/O policy and metadata bounds;
    ``trust_pickle`` (see [Note: DCP's metadata is a pickle])."""
    f = get_format(fmt or detect_format(url, storage_options))
    if step is not None and not f.steps:
        raise ValueError(f"a step was given but {url} is a {f.name} checkpoint, which has no steps")
    options = options or LoadOptions()
    return f.open(Store(url, storage_options, options.io), step, chunk, trust_pickle, options)
