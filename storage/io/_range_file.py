"""A byte range of a stored object as a seekable read-only file (``Store.open``), with a
read-ahead window so that a zip directory's dozens of tiny reads cost one request."""

from __future__ import annotations

import io
from typing import Any, Protocol


class _Store(Protocol):  # what RangeFile needs of a Store (_fs.py imports this module)
    def read_range(self, rel: str, start: int, end: int) -> bytes: ...

    def read_into(self, rel: str, start: int, out: Any) -> None: ...


_READ_AHEAD = 64 << 10  # what a small read fetches


class RangeFile(io.RawIOBase):
    """A byte range of an object as a seekable read-only file: a small read fetches up to
    ``_READ_AHEAD`` bytes for the next ones, a large one goes straight into the caller's buffer."""

    def __init__(self, store: _Store, rel: str, start: int, length: int) -> None:
        super().__init__()
        self.store, self.rel, self.start, self.length, self.pos = store, rel, start, length, 0
        self._ahead, self._ahead_at = b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
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
