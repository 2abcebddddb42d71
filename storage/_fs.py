"""A tiny storage interface over ``str`` URLs (fsspec), with retries and atomic local writes.

[Note: commit on filesystems vs object stores]
On a local filesystem every object is written to a temporary name, fsynced and renamed, so a
name that exists always holds complete bytes. Object stores have no rename, but a PUT (or a
completed multipart upload) is atomic: an object is either absent or whole. Either way the
manifest's existence is the commit of a step.

[Note: reading local files through the page cache]
A local object is read by mapping the byte range (``mmap``, populated up front) instead of
``read()`` into fresh memory: the checksums are computed on the page cache's own pages and the
bytes are copied once, into the target, after every rank has verified its reads. That saves the
kernel's copy into the process and the zero-filling of a fresh buffer, the two largest costs of
a load after the disk. Objects are immutable once written (new names, rename), so a mapping
never sees them change; the size is checked before mapping, so a truncated object raises
instead of faulting.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from typing import IO, Any

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ftsdp.storage._options import IOOptions
from ftsdp.storage._retry import retry
from ftsdp.storage._streaming import atomic_write


class Store:
    """An fsspec filesystem rooted at ``url``; every path argument is relative to the root."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None, io: IOOptions | None = None
    ) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(f"url must be a str or path, got {type(url).__name__}")
        self.url = str(url).rstrip("/")
        self.io = io or IOOptions()
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    def full(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def where(self, rel: str = "") -> str:
        """A URL for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def _retry(self, fn: Callable[[], Any]) -> Any:
        return retry(self.io, fn)

    def invalidate(self, rel: str = "") -> None:
        """Drop cached listings (other processes write here too)."""
        self.fs.invalidate_cache(self.full(rel))

    def exists(self, rel: str = "") -> bool:
        self.invalidate(rel)
        return self._retry(lambda: self.fs.exists(self.full(rel)))

    def listdir(self, rel: str = "") -> dict[str, tuple[str, int]]:
        """``{name: (type, size)}`` of the entries directly under ``rel``; {} when absent."""
        self.invalidate(rel)
        try:
            entries = self._retry(lambda: self.fs.ls(self.full(rel), detail=True))
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            out[name] = (e.get("type", "file"), int(e.get("size") or 0))
        return out

    def read(self, rel: str) -> bytes:
        return self._retry(lambda: self.fs.cat_file(self.full(rel)))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        data = self._retry(lambda: self.fs.cat_file(self.full(rel), start=start, end=end))
        if len(data) != end - start:
            raise OSError(
                f"short read of {self.where(rel)} bytes [{start}, {end}): got {len(data)}"
            )
        return data

    def map_range(self, rel: str, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` of a local file as a read-only uint8 array over a memory map
        of the page cache (see [Note: reading local files through the page cache])."""
        if not self.local:
            raise ValueError(f"map_range needs a local file, not {self.where(rel)}")
        fd = os.open(self.full(rel), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < end:  # mapping past the end would fault (SIGBUS) on access
                raise OSError(
                    f"short read of {self.where(rel)} bytes [{start}, {end}): the object has "
                    f"{size} bytes; it is truncated"
                )
            base = start - start % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(
                fd,
                end - base,
                flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                prot=mmap.PROT_READ,
                offset=base,
            )
        finally:
            os.close(fd)
        return np.frombuffer(mm, dtype=np.uint8, count=end - start, offset=start - base)

    def write(self, rel: str, produce: Callable[[IO[bytes]], None]) -> None:
        """Write an object whose bytes ``produce(f)`` writes to ``f``; atomic (see the note)."""
        self._retry(lambda: self._write_once(rel, produce))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.write(rel, lambda f: f.write(data))

    def _write_once(self, rel: str, produce: Callable[[IO[bytes]], None]) -> None:
        with atomic_write(self.fs, self.full(rel), self.io.part_bytes) as f:
            produce(f)

    def remove(self, rel: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.rm(self.full(rel), recursive=recursive))
        self.invalidate(rel.rsplit("/", 1)[0] if "/" in rel else "")
