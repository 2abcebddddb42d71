"""The store on a local disk: metadata and listings from the OS, reads into buffers and
memory-mapped ranges (docs/format.md, "Integrity"), atomic writes (temporary name, fsync, rename,
fsync of the folder; private under a private root), exclusive creates, symlink containment, tmpfs
detection."""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import IO, Any

import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ftsdp.storage._errors import CorruptCheckpointError
from ftsdp.storage.io._buffers import host_buffer
from ftsdp.storage.io._fs import Store, once

_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


class LocalStore(Store):
    """A ``Store`` on a local disk; the answers are fsspec's (links followed, dangling: absent)."""

    local = True

    @staticmethod
    def _serves(fs: Any) -> bool:
        return isinstance(fs, LocalFileSystem)

    @once
    def tmpfs(self) -> bool:
        """Whether the root is on a tmpfs mount (host memory: ``/dev/shm``), by the mount table."""
        return _mount_type(self.root) == "tmpfs"

    @once
    def _private(self) -> bool:
        """Whether the root lets no group or other user in (the memory tier's, mode 0700): its
        files are then written 0600 and its folders 0700, whatever the umask. Other roots keep
        the umask's modes (a shared root on a team's disk may grant its group access)."""
        try:
            return os.stat(self.root).st_mode & 0o077 == 0
        except OSError:
            return False

    def exists(self, rel: str = "") -> bool:
        return self._retry(lambda: os.path.exists(self.full(rel)))

    def isfile(self, rel: str = "") -> bool:
        return self._retry(lambda: os.path.isfile(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        return self._retry(lambda: os.path.isdir(self.full(rel)))

    def modified(self, rel: str) -> float:
        return self._retry(lambda: os.lstat(self.full(rel)).st_mtime)

    def listdir(self, rel: str = "") -> dict[str, tuple[str, int]]:
        try:
            return self._retry(lambda: _scan_local(self.full(rel)))
        except FileNotFoundError:
            return {}

    def is_link(self, rel: str) -> bool:
        return os.path.islink(self.full(rel))

    def inside_root(self, rel: str) -> bool:
        # Without a link or ".." below the root, rel stays inside whatever the root resolves to.
        path = self.root
        for part in rel.split("/"):
            if part in ("", "."):
                continue
            path = f"{path}/{part}"
            if part == ".." or os.path.islink(path):
                root = os.path.realpath(self.root)
                return os.path.commonpath([root, os.path.realpath(self.full(rel))]) == root
        return True

    def hold(self, rel: str = "") -> None:
        held = self.__dict__.setdefault("_held", {})
        if rel not in held:
            held[rel] = _HeldFile(self.full(rel), self.where(rel))

    def release(self) -> None:
        for f in self.__dict__.get("_held", {}).values():
            f.close()

    def _holding(self, rel: str) -> _HeldFile | None:
        return self.__dict__.get("_held", {}).get(rel)

    def size(self, rel: str = "") -> int:
        held = self._holding(rel)
        if held is not None:
            return held.size
        return self._retry(lambda: os.stat(self.full(rel)).st_size)

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        if self._holding(rel) is None:
            return super().read_range(rel, start, end)
        data = bytearray(end - start)
        self.read_into(rel, start, data)
        return bytes(data)

    def _read_at(self, rel: str, start: int, view: memoryview) -> int:
        held = self._holding(rel)
        if held is not None:
            return held.read(start, view)
        with open(self.full(rel), "rb") as f:
            f.seek(start)
            return f.readinto(view)

    def map_range(self, rel: str, start: int, end: int) -> np.ndarray:
        return self._range(rel, start, end, mapped=True)

    def stable_range(self, rel: str, start: int, end: int) -> np.ndarray:
        # docs/format.md, "Integrity": one name, mapped; more, read privately
        return self._retry(lambda: self._range(rel, start, end, mapped=False))

    def _range(self, rel: str, start: int, end: int, mapped: bool) -> np.ndarray:
        """Bytes ``[start, end)`` of ``rel`` from one open file: mapped when ``mapped`` or when
        the file has one link, else read into private memory."""
        fd = os.open(self.full(rel), os.O_RDONLY)
        try:
            st = os.fstat(fd)
            if st.st_size < end:  # mapping past the end would fault (SIGBUS) on access
                raise OSError(
                    f"short read of {self.where(rel)} bytes [{start}, {end}): the object has "
                    f"{st.st_size} bytes; it is truncated"
                )
            if mapped or st.st_nlink == 1:
                return _map(fd, start, end)
            data = host_buffer(end - start, populate=True).numpy()
            got = _pread_all(fd, data.data, start)
            if got < end - start:
                raise OSError(
                    f"short read of {self.where(rel)} bytes [{start}, {end}): got {got}; the "
                    "file is truncated"
                )
            return data
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _atomic_write(self, path: str, exclusive: bool = False) -> Iterator[IO[bytes]]:
        """``path`` exists only complete: a temporary name (``<name>.tmp-<8 hex>``), fsynced and
        renamed, or with ``exclusive`` linked (FileExistsError when ``path`` exists)."""
        folder = os.path.dirname(path) or "."
        private = self._private
        os.makedirs(folder, mode=0o700 if private else 0o777, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        mode = 0o600 if private else 0o666
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
                if exclusive:
                    _link_exclusive(tmp, path, mode)
                else:
                    os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # make the rename itself durable
        finally:
            os.close(fd)

    def remove_empty_dir(self, rel: str) -> bool:
        try:
            os.rmdir(self.full(rel))
        except FileNotFoundError:
            pass
        except OSError:
            return False
        self.invalidate(self._parent(rel))
        return True


class _HeldFile:
    """What a file was when ``LocalStore.hold`` took it: each read opens it again and checks,
    before and after, that it is still that file (docs/cli.md, "Python API for inference": "Files
    that change while open")."""

    def __init__(self, path: str, where: str) -> None:
        self.path, self.where = path, where
        st = os.stat(path)
        self.size, self._stamp = st.st_size, _stamp(st)
        self._closed = False

    def read(self, start: int, view: memoryview) -> int:
        """Bytes from ``start`` into ``view``; the number read (fewer only at the end)."""
        if self._closed:
            raise ValueError(f"{self.where} was released (its reader is closed)")
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self._check(os.fstat(fd))
            got = _pread_all(fd, view, start)
            self._check(os.fstat(fd))  # a rewrite that raced the read has changed it by now
            return got
        finally:
            os.close(fd)

    def _check(self, st: os.stat_result) -> None:
        if _stamp(st) == self._stamp:
            return
        if (st.st_dev, st.st_ino) != self._stamp[:2]:
            how = "replaced by another file"
        elif st.st_size != self.size:
            how = f"now {st.st_size} bytes, {self.size} then"
        else:
            how = "written in place"
        raise CorruptCheckpointError(
            f"{self.where} changed since it was opened ({how}): the offsets read from it then "
            "no longer hold; open the checkpoint again"
        )

    def close(self) -> None:
        self._closed = True


def _pread_all(fd: int, view: memoryview, start: int) -> int:
    """Read ``fd`` from ``start`` into ``view`` until it is full or the file ends; the count."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], start + got)
        if n == 0:
            break
        got += n
    return got


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _map(fd: int, start: int, end: int) -> np.ndarray:
    """Bytes ``[start, end)`` of the open file ``fd`` mapped read-only, populated up front."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(
        fd,
        end - base,
        flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
        prot=mmap.PROT_READ,
        offset=base,
    )
    return np.frombuffer(mm, dtype=np.uint8, count=end - start, offset=start - base)


def _link_exclusive(tmp: str, path: str, mode: int) -> None:
    """Publish ``tmp`` as ``path`` unless it exists (FileExistsError): a hard link, or without
    links a copy into a file created with ``O_EXCL``."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as dst, open(tmp, "rb") as src:
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


def _scan_local(path: str) -> dict[str, tuple[str, int]]:
    """What ``LocalFileSystem.ls(path, detail=True)`` tells of each entry, in one ``scandir``
    (a link is "other", sized as its target or 0); a file lists itself."""
    st = os.stat(path)  # FileNotFoundError when absent
    if not stat.S_ISDIR(st.st_mode):
        kind = "file" if stat.S_ISREG(st.st_mode) else "other"
        return {path.rstrip("/").rsplit("/", 1)[-1]: (kind, st.st_size)}
    out = {}
    with os.scandir(path) as entries:
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    kind = "directory"
                else:
                    kind = "file" if e.is_file(follow_symlinks=False) else "other"
                size = e.stat(follow_symlinks=False).st_size
                if e.is_symlink():
                    try:
                        size = e.stat(follow_symlinks=True).st_size
                    except OSError:
                        size = 0
            except FileNotFoundError:  # removed while listed
                continue
            out[e.name] = (kind, size)
    return out


def _mount_type(path: str) -> str | None:
    """The filesystem type of the mount holding ``path`` (its nearest existing ancestor), matched
    by device number (not by mount path: bind mounts); None when unknown."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and path != "/":
        path = os.path.dirname(path)
    return _device_fs_type(os.stat(path).st_dev)


@functools.cache
def _device_fs_type(dev: int) -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    kinds = set()
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 3 and fields[2] == f"{os.major(dev)}:{os.minor(dev)}" and right:
            kinds.add(right.split()[0])
    return kinds.pop() if len(kinds) == 1 else None  # one device, one filesystem
