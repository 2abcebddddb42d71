"""The one store layer (docs/design.md, "One store layer"): every read and write of every format
goes through a ``Store``, an fsspec filesystem rooted at a URL; paths are relative to the root
(``""``: the root itself, a directory or a single file). ``Store(url)`` builds the backend for the
URL's filesystem: ``LocalStore`` (``_local.py``), ``S3Store`` (``_s3.py``) or this generic one."""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from io import SEEK_CUR, SEEK_END, SEEK_SET, RawIOBase
from typing import IO, Any, Generic, TypeVar

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ftsdp.storage._errors import CorruptCheckpointError
from ftsdp.storage._options import IOOptions
from ftsdp.storage.io._buffers import host_buffer
from ftsdp.storage.io._retry import retry

_PLAIN_NAME = re.compile(r"[^/\\:\x00-\x1f\x7f]{1,255}")


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is one file name inside a checkpoint's folder, as every pointer inside a
    checkpoint must be: 1 to 255 characters without ``/``, ``\\``, ``:``, control characters or
    surrounding whitespace, and not ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and _PLAIN_NAME.fullmatch(name) is not None
        and name == name.strip()
        and name not in (".", "..")
    )


_T = TypeVar("_T")


class once(Generic[_T]):
    """A property computed on first use and kept on the instance: ``functools.cached_property``
    without its lock. Before Python 3.12 that lock is one for every instance of the class, and
    a child forked while another thread computed the property inherits it held: the child's
    first use waits for good (a forked child's own save hung in a store's ``_private``)."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]
        value = obj.__dict__[self.name] = self.fn(obj)  # computing twice at once is harmless
        return value


class Store:
    """An fsspec filesystem rooted at ``url``; every path argument is relative to the root."""

    local = False  # a local disk (``LocalStore``): ``map_range`` works, objects have real paths

    def __new__(cls, url: Any = None, storage_options: Any = None, io: Any = None) -> Store:
        # The subclass that serves the URL's filesystem; no url: unpickling.
        if cls is Store and isinstance(url, (str, os.PathLike)):
            fs = fsspec.core.url_to_fs(str(url).rstrip("/"), **(storage_options or {}))[0]
            cls = next((b for b in Store.__subclasses__() if b._serves(fs)), Store)
        return super().__new__(cls)

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None, io: IOOptions | None = None
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(f"url must be a str or path, got {type(url).__name__}")
        if not str(url).strip():  # not "the working directory": name it ("." does)
            raise ValueError("the checkpoint URL is empty")
        self.url = str(url).rstrip("/")
        self.io = io or IOOptions()
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")

    @staticmethod
    def _serves(fs: Any) -> bool:
        """Whether this backend is the one for fsspec filesystem ``fs`` (else ``Store`` is)."""
        return False

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    @property
    def tmpfs(self) -> bool:
        """Whether the root is on a tmpfs mount (host memory: ``/dev/shm``)."""
        return False

    def where(self, rel: str = "") -> str:
        """A URL for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def _retry(self, fn: Callable[[], Any]) -> Any:
        return retry(self.io, fn)

    def invalidate(self, rel: str = "") -> None:
        """Drop cached listings (other processes write here too)."""
        self.fs.invalidate_cache(self.full(rel))

    def _parent(self, rel: str) -> str:
        return rel.rsplit("/", 1)[0] if "/" in rel else ""

    # -- identity: where the root is, whatever URL names it ----------------------------------------

    def location(self) -> tuple[str, str]:
        """``(filesystem, absolute path)`` of the root, one spelling per place: local paths
        resolved, a filesystem named by its class (not its alias), object keys normalised,
        caching wrappers seen through."""
        fs, root = self.fs, self.root
        inner = getattr(fs, "fs", None)
        while isinstance(inner, fsspec.AbstractFileSystem) and inner is not fs:  # a wrapper
            root = fs._join(root) if hasattr(fs, "_join") else root  # DirFileSystem's prefix
            fs, inner = inner, getattr(inner, "fs", None)
        if isinstance(fs, LocalFileSystem):
            return "file", os.path.realpath(root)
        return f"{type(fs).__module__}.{type(fs).__qualname__}", posixpath.normpath(
            "/" + root.lstrip("/")
        )

    def contains(self, other: Store) -> bool:
        """Whether ``other``'s root is this root or lies inside it (local paths also by
        ``os.path.samefile``: bind mounts, case-insensitive filesystems)."""
        (kind, mine), (other_kind, path) = self.location(), other.location()
        if kind != other_kind:
            return False
        if path == mine or path.startswith(mine.rstrip("/") + "/"):
            return True
        if kind != "file" or not os.path.exists(mine):
            return False
        while True:  # an existing ancestor of ``other`` (or itself) that is this root
            if os.path.exists(path) and os.path.samefile(path, mine):
                return True
            parent = os.path.dirname(path)
            if parent == path:
                return False
            path = parent

    # -- metadata ---------------------------------------------------------------------------------

    def exists(self, rel: str = "") -> bool:
        self.invalidate(rel)
        return self._retry(lambda: self.fs.exists(self.full(rel)))

    def isfile(self, rel: str = "") -> bool:
        self.invalidate(rel)
        return self._retry(lambda: self.fs.isfile(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        self.invalidate(rel)
        return self._retry(lambda: self.fs.isdir(self.full(rel)))

    def size(self, rel: str = "") -> int:
        """The size of an object in bytes; FileNotFoundError when it does not exist."""
        return int(self._retry(lambda: self.fs.size(self.full(rel))))

    def modified(self, rel: str) -> float:
        """When ``rel`` was last written, in seconds since the epoch; FileNotFoundError when
        it does not exist."""
        return float(self._retry(lambda: self.fs.modified(self.full(rel))).timestamp())

    def listdir(self, rel: str = "") -> dict[str, tuple[str, int]]:
        """``{name: (type, size)}`` of the entries directly under ``rel``; {} when absent."""
        self.invalidate(rel)
        try:
            entries = self._retry(lambda: self.fs.ls(self.full(rel), detail=True))
        except FileNotFoundError:
            return {}
        finally:  # every listing is read fresh: one kept would only grow (on S3, s3fs keeps
            self.invalidate(rel)  # each listed directory's entries for good)
        out, here = {}, self.full(rel).rstrip("/")
        for e in entries:
            if e["name"].rstrip("/") == here:  # the directory's own marker (SeaweedFS keeps one)
                continue
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            out[name] = (e.get("type", "file"), int(e.get("size") or 0))
        return out

    def is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symbolic link (only local disks have them)."""
        return False

    def inside_root(self, rel: str) -> bool:
        """Whether ``rel`` resolves (links followed) to a path inside the root's own resolved
        path; always True on stores without links."""
        return True

    # -- reading ----------------------------------------------------------------------------------

    def read(self, rel: str = "") -> bytes:
        return self._retry(lambda: self.fs.cat_file(self.full(rel)))

    def read_bounded(self, rel: str, max_bytes: int) -> bytes:
        """A whole metadata file of at most ``max_bytes`` (CorruptCheckpointError otherwise): the
        size is asked first, so a huge file or an endless device is refused unread."""
        size = self.size(rel)
        if size > max_bytes:
            raise CorruptCheckpointError(
                f"{self.where(rel)} has {size} bytes, more than the {max_bytes} allowed for "
                "metadata; refusing to read it"
            )
        try:
            return self.read_range(rel, 0, size) if size else b""
        except (IsADirectoryError, NotADirectoryError):
            raise CorruptCheckpointError(f"{self.where(rel)} is not a file") from None

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        data = self._retry(lambda: self.fs.cat_file(self.full(rel), start=start, end=end))
        if len(data) != end - start:
            raise OSError(
                f"short read of {self.where(rel)} bytes [{start}, {end}): got {len(data)}"
            )
        return data

    def read_into(self, rel: str, start: int, out: Any) -> None:
        """Fill the writable buffer ``out`` with the bytes of ``rel`` from ``start`` on."""
        view = memoryview(out).cast("B")
        if len(view):
            self._retry(lambda: self._read_into_once(rel, start, view))

    def _read_into_once(self, rel: str, start: int, view: memoryview) -> None:
        # Every buffer read passes here, whatever the backend (tests watch it).
        end = start + len(view)
        got = self._read_at(rel, start, view)
        if got != end - start:
            raise OSError(
                f"short read of {self.where(rel)} bytes [{start}, {end}): got {got}; the file "
                "is truncated"
            )

    def _read_at(self, rel: str, start: int, view: memoryview) -> int:
        """Read ``rel`` from ``start`` into ``view``; the number of bytes read."""
        data = self.fs.cat_file(self.full(rel), start=start, end=start + len(view))
        view[: len(data)] = data
        return len(data)

    def hold(self, rel: str = "") -> None:
        """Read ``rel`` from now on only as it is now, where the backend can tell (``LocalStore``:
        a file replaced or rewritten since raises ``CorruptCheckpointError`` when read). Here, on
        an object store, nothing is noted: each read is a request by name, so an object replaced
        since is read as it is then."""

    def release(self) -> None:
        """Let go of what ``hold`` holds; reading a held object afterwards raises ValueError."""

    def open(self, rel: str = "", start: int = 0, end: int | None = None) -> RangeFile:
        """Bytes ``[start, end)`` of ``rel`` (``end``: its size) as a seekable read-only file;
        FileNotFoundError when absent."""
        if end is None:
            end = self.size(rel)
        return RangeFile(self, rel, start, end - start)

    def map_range(self, rel: str, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` of a local file as a read-only memory-mapped uint8 array."""
        raise ValueError(f"map_range needs a local file, not {self.where(rel)}")

    def stable_range(self, rel: str, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` of ``rel`` as a uint8 array that no write to the object can
        change afterwards, so that what a reader verified is what it copies: here read into a
        private buffer (``LocalStore`` maps an object that has no other name)."""
        data = host_buffer(end - start, populate=True).numpy()
        self.read_into(rel, start, data)
        return data

    # -- writing ----------------------------------------------------------------------------------

    def write(self, rel: str, produce: Callable[[IO[bytes]], None]) -> None:
        """Write an object whose bytes ``produce(f)`` writes to ``f``, atomically; a transient
        error retries the whole object, so ``produce`` must be able to run again."""
        self._retry(lambda: self._write_once(rel, produce))

    def write_bytes(self, rel: str, data: bytes) -> None:
        def produce(f: IO[bytes]) -> None:
            f.write(data)

        self.write(rel, produce)

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` holding ``data`` only if no object of that name exists, else
        FileExistsError (docs/format.md, "Commit protocol": which stores can be raced)."""
        self._retry(lambda: self._write_once(rel, _CreateOnly(data)))

    def _write_once(self, rel: str, produce: Callable[[IO[bytes]], None]) -> None:
        # Every write, exclusive or not, passes here (one place where tests watch or fail writes).
        try:
            with self._atomic_write(self.full(rel), isinstance(produce, _CreateOnly)) as f:
                produce(f)
        except OSError as e:
            if e.filename is None and e.errno is not None:  # a bare "No space left on device"
                raise OSError(e.errno, e.strerror, self.where(rel)) from e  # (its subclass)
            raise

    @contextlib.contextmanager
    def _atomic_write(self, path: str, exclusive: bool = False) -> Iterator[IO[bytes]]:
        """``path`` exists only complete (an upload discarded when the body raises); with
        ``exclusive``, only if it does not exist yet."""
        native = exclusive and self._creates_exclusively()
        if exclusive and not native and self.fs.exists(path):
            raise FileExistsError(f"{path} already exists")
        f = self._upload(path, max(self.io.part_bytes, 5 << 20), native)  # S3's smallest part
        try:
            yield f
        except BaseException:
            # Closing would complete the upload and publish a partial object: abort it, and mark
            # the file closed so that its finalizer does not try to finish it either.
            with contextlib.suppress(Exception):
                if hasattr(f, "discard"):
                    f.discard()
                    f.closed = True
            raise
        f.close()

    def _upload(self, path: str, part_bytes: int, exclusive: bool) -> Any:
        """A write-only file whose ``close`` publishes ``path`` (``exclusive``: FileExistsError
        when the name is taken)."""
        return self.fs.open(path, "xb" if exclusive else "wb", block_size=part_bytes)

    def _creates_exclusively(self) -> bool:
        """Whether this store honours an ``"xb"`` open (create only if absent)."""
        return isinstance(self.fs, MemoryFileSystem)

    # -- removing ---------------------------------------------------------------------------------

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.rm(self.full(rel)))
        self.invalidate(self._parent(rel))

    def remove_empty_dir(self, rel: str) -> bool:
        """Remove the directory ``rel`` if it is empty (never its contents); True if it is gone."""
        if self.listdir(rel):
            return False
        with contextlib.suppress(OSError):  # absent already, or a prefix that is no directory
            self.fs.rmdir(self.full(rel))
        return True


class _CreateOnly:
    """The producer of ``write_exclusive`` (the flag rides on it: every write goes through
    ``_write_once``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __call__(self, f: IO[bytes]) -> None:
        f.write(self.data)


_READ_AHEAD = 64 << 10  # what a small read of a ``RangeFile`` fetches


class RangeFile(RawIOBase):
    """A byte range of an object as a seekable read-only file (``Store.open``): a small read
    fetches up to ``_READ_AHEAD`` bytes for the next ones (a zip directory's dozens of tiny reads
    cost one request), a large one goes straight into the caller's buffer."""

    def __init__(self, store: Store, rel: str, start: int, length: int) -> None:
        super().__init__()
        self.store, self.rel, self.start, self.length, self.pos = store, rel, start, length, 0
        self._ahead, self._ahead_at = b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = SEEK_SET) -> int:
        base = {SEEK_SET: 0, SEEK_CUR: self.pos, SEEK_END: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readall(self) -> bytes:
        out = bytearray(self.length - self.pos)
        self.readinto(out)
        return bytes(out)

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        lo = self.pos - self._ahead_at
        if 0 <= lo and lo + n <= len(self._ahead):
            view[:n] = self._ahead[lo : lo + n]
        elif n < _READ_AHEAD:
            take = min(_READ_AHEAD, self.length - self.pos)
            at = self.start + self.pos
            self._ahead, self._ahead_at = self.store.read_range(self.rel, at, at + take), self.pos
            view[:n] = self._ahead[:n]
        else:
            self.store.read_into(self.rel, self.start + self.pos, view[:n])
        self.pos += n
        return n
