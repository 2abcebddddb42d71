"""The one store layer: every read and write of every format goes through a ``Store``.

A ``Store`` is an fsspec filesystem rooted at a URL; every path argument is relative to the root,
and ``""`` is the root itself, which may be a directory (a checkpoint root, an hf or DCP folder)
or a single file (a ``.safetensors`` or ``torch.save`` file). Each operation retries
known-transient errors (``_retry.py``), writes are atomic (see the note), and ranged reads are
memory-mapped for local files. This is the only module that touches fsspec.

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

Mapping costs one page-table entry per cached page: on a kernel that caches files in large
folios (ext4 and XFS on recent Linux) a range cached as 2 MiB folios maps many times faster
than one cached as 4 KiB pages (docs/benchmarks.md, "Verify (warm)"), which is the difference
between a verify or warm load bound by the checksum and one bound by the mapping. Which folios a file gets depends on how it was written: writes of 2 MiB or more that
start on a multiple of their size get large ones; 1 MiB writes, or writes shifted by a header,
get small ones. So ``write_object`` (``_safetensors.py``) hands the data to the file in spans
that end on multiples of 2 MiB of the object, whatever the header's length.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import io
import mmap
import os
import posixpath
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from typing import IO, Any

import fsspec
import numpy as np
from crc32c import crc32c  # the checksum S3 verifies on upload (x-amz-checksum-crc32c)
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ftsdp.storage._errors import CorruptCheckpointError
from ftsdp.storage._options import IOOptions
from ftsdp.storage.io._retry import retry

MiB = 1 << 20
_READ_AHEAD = 64 << 10  # what a small read of an opened object fetches (see RangeFile)
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


_PLAIN_NAME = re.compile(r"[^/\\:\x00-\x1f\x7f]{1,255}")


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is one file name inside a checkpoint's folder, as every pointer inside a
    checkpoint must be (an hf index's files, DCP's ``relative_path``): a str of 1 to 255
    characters without ``/``, ``\\``, ``:`` (a scheme or drive), control characters (NUL, newline)
    or surrounding whitespace, and not ``.`` or ``..``."""
    return (
        isinstance(name, str)
        and _PLAIN_NAME.fullmatch(name) is not None
        and name == name.strip()
        and name not in (".", "..")
    )


def _scan_local(path: str) -> dict[str, tuple[str, int]]:
    """What ``LocalFileSystem.ls(path, detail=True)`` tells of each entry, in one ``scandir``:
    the type of the entry itself ("directory", "file", or "other" for a link or a device), and
    its size, a link's that of its target (0 when dangling). ``path`` itself is followed when it
    is a link; a file lists itself."""
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
                elif e.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
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
    """The filesystem type of the mount holding ``path`` (its nearest existing ancestor): the
    mount table's entry whose device (``major:minor``) is that of ``path``, so that neither a
    bind mount nor a mount hidden under another one is taken for it; None when unknown."""
    path = os.path.realpath(path)
    while not os.path.exists(path) and path != "/":
        path = os.path.dirname(path)
    dev = os.stat(path).st_dev
    if dev not in _mount_types:
        _mount_types[dev] = _read_mount_type(f"{os.major(dev)}:{os.minor(dev)}")
    return _mount_types[dev]


_mount_types: dict[int, str | None] = {}


def _read_mount_type(device: str) -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    kinds = set()
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 3 and fields[2] == device and right:
            kinds.add(right.split()[0])
    return kinds.pop() if len(kinds) == 1 else None  # one device, one filesystem


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

    @functools.cached_property
    def tmpfs(self) -> bool:
        """Whether the root is on a tmpfs mount (host memory: ``/dev/shm``), by the mount table."""
        return self.local and _mount_type(self.root) == "tmpfs"

    def where(self, rel: str = "") -> str:
        """A URL for messages."""
        return f"{self.url}/{rel}" if rel else self.url

    def _retry(self, fn: Callable[[], Any]) -> Any:
        return retry(self.io, fn)

    def invalidate(self, rel: str = "") -> None:
        """Drop cached listings (other processes write here too)."""
        self.fs.invalidate_cache(self.full(rel))

    # -- identity: where the root is, whatever URL names it ----------------------------------------

    def location(self) -> tuple[str, str]:
        """``(filesystem, absolute path)`` of the root, one spelling per place: ``file://``, relative
        paths and symlinks resolve to one local real path; fsspec's aliases of one filesystem
        (``s3``/``s3a``, ``gs``/``gcs``) are one filesystem (its class); an object store's
        ``bucket/key`` is normalised (``//``, ``.``, ``..``); caching wrappers are seen through."""
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
        """Whether ``other``'s root is this root or lies inside it (see ``location``). Local paths
        are also compared by identity (``os.path.samefile``), which sees through bind mounts and
        case-insensitive filesystems."""
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

    # On a local disk these ask the OS directly, with fsspec's answers (links followed, a
    # dangling one absent), without fsspec's path handling: a save asks a few dozen times.

    def exists(self, rel: str = "") -> bool:
        if self.local:
            return self._retry(lambda: os.path.exists(self.full(rel)))
        self.invalidate(rel)
        return self._retry(lambda: self.fs.exists(self.full(rel)))

    def isfile(self, rel: str = "") -> bool:
        if self.local:
            return self._retry(lambda: os.path.isfile(self.full(rel)))
        self.invalidate(rel)
        return self._retry(lambda: self.fs.isfile(self.full(rel)))

    def isdir(self, rel: str = "") -> bool:
        if self.local:
            return self._retry(lambda: os.path.isdir(self.full(rel)))
        self.invalidate(rel)
        return self._retry(lambda: self.fs.isdir(self.full(rel)))

    def size(self, rel: str = "") -> int:
        """The size of an object in bytes; FileNotFoundError when it does not exist."""
        if self.local:
            return self._retry(lambda: os.stat(self.full(rel)).st_size)
        return int(self._retry(lambda: self.fs.size(self.full(rel))))

    def disk_usage(self, rel: str = "") -> int:
        """Bytes held by an object, or by everything under a directory."""
        return int(self._retry(lambda: self.fs.du(self.full(rel))))

    def listdir(self, rel: str = "") -> dict[str, tuple[str, int]]:
        """``{name: (type, size)}`` of the entries directly under ``rel``; {} when absent."""
        if self.local:  # one scandir, without fsspec's path handling
            try:
                return self._retry(lambda: _scan_local(self.full(rel)))
            except FileNotFoundError:
                return {}
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

    # -- reading ----------------------------------------------------------------------------------

    def read(self, rel: str = "") -> bytes:
        return self._retry(lambda: self.fs.cat_file(self.full(rel)))

    def read_bounded(self, rel: str, max_bytes: int) -> bytes:
        """A whole metadata file (an index, a marker, DCP's ``.metadata``) of at most
        ``max_bytes``: the size is asked first and only that many bytes are read, so a huge file
        or a link to an endless device is refused instead of read (CorruptCheckpointError)."""
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
        """Fill the writable buffer ``out`` (a memoryview, a numpy array, ...) with the bytes of
        ``rel`` from ``start`` on; local files are read straight into it (no second copy)."""
        view = memoryview(out).cast("B")
        if len(view):
            self._retry(lambda: self._read_into_once(rel, start, view))

    def _read_into_once(self, rel: str, start: int, view: memoryview) -> None:
        end = start + len(view)
        if self.local:
            with open(self.full(rel), "rb") as f:
                f.seek(start)
                got = f.readinto(view)
        else:
            data = self.fs.cat_file(self.full(rel), start=start, end=end)
            got = len(data)
            view[:got] = data
        if got != end - start:
            raise OSError(
                f"short read of {self.where(rel)} bytes [{start}, {end}): got {got}; the file "
                "is truncated"
            )

    def open(self, rel: str = "", start: int = 0, end: int | None = None) -> RangeFile:
        """Bytes ``[start, end)`` of ``rel`` (``end``: its size) as a seekable read-only file, for
        readers that want a file object (``torch.load``). FileNotFoundError when absent."""
        if end is None:
            end = self.size(rel)
        return RangeFile(self, rel, start, end - start)

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

    # -- writing ----------------------------------------------------------------------------------

    def write(self, rel: str, produce: Callable[[IO[bytes]], None]) -> None:
        """Write an object whose bytes ``produce(f)`` writes to ``f``, atomically (see the note).

        A transient error retries the whole object, so ``produce`` must be able to run again
        from the start (it writes a new file each time); ``io.part_bytes`` is the upload buffer.
        """
        self._retry(lambda: self._write_once(rel, produce))

    def write_bytes(self, rel: str, data: bytes) -> None:
        def produce(f: IO[bytes]) -> None:
            f.write(data)

        self.write(rel, produce)

    def _write_once(self, rel: str, produce: Callable[[IO[bytes]], None]) -> None:
        with self._atomic_write(self.full(rel), isinstance(produce, _CreateOnly)) as f:
            produce(f)

    @contextlib.contextmanager
    def _atomic_write(self, path: str, exclusive: bool = False) -> Iterator[IO[bytes]]:
        """``path`` exists only complete: a temporary name renamed on a local disk, an upload
        that is discarded (never completed) on an object store when the body raises. With
        ``exclusive``, only if ``path`` does not exist yet (see ``write_exclusive``)."""
        f: Any  # a local file, an S3Upload or an fsspec file
        if self.local:
            folder = os.path.dirname(path) or "."
            os.makedirs(folder, exist_ok=True)
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                with open(tmp, "xb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
                    if exclusive:
                        _link_exclusive(tmp, path)
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
            return
        native = exclusive and self._creates_exclusively()
        if exclusive and not native and self.fs.exists(path):
            raise FileExistsError(f"{path} already exists")
        part_bytes = max(self.io.part_bytes, 5 * MiB)  # S3's smallest part but the last
        if self.io.object_checksums and self._is_s3():
            f = S3Upload(self.fs, path, part_bytes, exclusive)
        else:
            mode = "xb" if native else "wb"  # "xb": FileExistsError on close (a 412 from S3)
            f = self.fs.open(path, mode, block_size=part_bytes)
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

    def remove(self, rel: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.rm(self.full(rel), recursive=recursive))
        self.invalidate(rel.rsplit("/", 1)[0] if "/" in rel else "")

    # -- exclusive creation and ownership checks (the commit; deleting only what is ours) --------

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Create ``rel`` holding ``data`` only if no object of that name exists; otherwise
        FileExistsError and nothing is written. Local disk: the temporary file is hard-linked to
        the name (``os.link`` fails when it exists; ``O_EXCL`` where the file system has no hard
        links) instead of renamed. S3 and memory://: an ``"xb"`` open, which s3fs sends as
        ``If-None-Match: *``. Any other store: an existence check, then the ordinary atomic
        write, which is not exclusive against a concurrent writer."""
        self._retry(lambda: self._write_once(rel, _CreateOnly(data)))

    def _creates_exclusively(self) -> bool:
        """Whether this object store honours an ``"xb"`` open (create only if absent)."""
        return isinstance(self.fs, MemoryFileSystem) or self._is_s3()

    def _is_s3(self) -> bool:
        proto = self.fs.protocol
        protocols = {proto} if isinstance(proto, str) else set(proto)
        return bool(protocols & {"s3", "s3a"})

    def is_link(self, rel: str) -> bool:
        """Whether ``rel`` is a symbolic link (only local disks have them)."""
        return self.local and os.path.islink(self.full(rel))

    def inside_root(self, rel: str) -> bool:
        """Whether ``rel`` resolves (links followed) to a path inside the root's own resolved
        path; always True on stores without links."""
        if not self.local:
            return True
        # Without a link or ".." below the root, rel stays inside whatever the root resolves to:
        # one lstat per component of rel, where resolving both paths lstats every component of
        # both (it runs twice per file a retention removes).
        path = self.root
        for part in rel.split("/"):
            if part in ("", "."):
                continue
            path = f"{path}/{part}"
            if part == ".." or os.path.islink(path):
                root = os.path.realpath(self.root)
                return os.path.commonpath([root, os.path.realpath(self.full(rel))]) == root
        return True

    def remove_empty_dir(self, rel: str) -> bool:
        """Remove the directory ``rel`` if it is empty (never its contents); True if it is gone.
        Object stores have no empty directories: there it is gone once nothing is under it."""
        if self.local:
            try:
                os.rmdir(self.full(rel))
            except FileNotFoundError:
                pass
            except OSError:
                return False
            self.invalidate(rel.rsplit("/", 1)[0] if "/" in rel else "")
            return True
        if self.listdir(rel):
            return False
        with contextlib.suppress(OSError):  # absent already, or a prefix that is no directory
            self.fs.rmdir(self.full(rel))
        return True


class _CreateOnly:
    """The producer of ``write_exclusive``: fixed bytes whose object is created only if absent.
    The flag rides on the producer so that every write, exclusive or not, goes through
    ``_write_once`` (one place where writes can be watched or failed in tests)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __call__(self, f: IO[bytes]) -> None:
        f.write(self.data)


def _link_exclusive(tmp: str, path: str) -> None:
    """Publish the complete file ``tmp`` as ``path`` unless ``path`` exists (FileExistsError):
    a hard link, or where the file system has none, a copy into a file created with
    ``O_EXCL`` (removed again if the copy fails)."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as dst, open(tmp, "rb") as src:
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise


def _b64_crc(value: int) -> str:
    """A CRC-32C as S3 spells it: the 4 bytes big-endian, base64."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class S3Upload:
    """A write-only file that uploads one S3 object carrying its CRC-32C as S3's own checksum.

    Every request sends the CRC-32C of its body (``x-amz-checksum-crc32c``), which S3 checks on
    arrival and refuses on a mismatch, so a byte damaged between this process and the store is
    caught at upload instead of at the next load; the stored object keeps the CRC-32C of its whole
    content (``head_object(ChecksumMode="ENABLED")``; type ``FULL_OBJECT`` for a multipart
    upload). One ``put_object`` when the object fits in a part, else a multipart upload of
    ``part_bytes`` parts (sent as they fill, one at a time). ``close()`` publishes the object;
    ``discard()`` aborts, so nothing appears. With ``exclusive`` the object is created only if
    its name is free (``If-None-Match: *``): ``close()`` raises FileExistsError otherwise.

    s3fs's own file cannot do this: it drops the parts' checksums when it completes a multipart
    upload (it keeps only SHA-256 ones), so its uploads are checked with the CRC-32 that botocore
    computes by default (zlib's, slower than the CRC-32C computed here).
    """

    def __init__(self, fs: Any, path: str, part_bytes: int, exclusive: bool) -> None:
        self.fs, self.path, self.part_bytes = fs, path, part_bytes
        self.bucket, self.key, _ = fs.split_path(path)
        self.match = {"IfNoneMatch": "*"} if exclusive else {}
        self.buf = bytearray()
        self.size = 0
        self.crc = 0  # of the whole object so far
        self.part_crc = 0  # of the bytes in ``buf``
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.closed = False

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        """Nothing to do: a part is sent once it is full, the rest on ``close``."""

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        while len(mv):
            take = min(len(mv), self.part_bytes - len(self.buf))
            chunk = mv[:take]
            self.crc = crc32c(chunk, self.crc)
            self.part_crc = crc32c(chunk, self.part_crc)
            self.buf += chunk
            mv = mv[take:]
            if len(self.buf) == self.part_bytes:
                self._send_part()
        self.size += n
        return n

    def _send_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = self.fs.call_s3(
                "create_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                ChecksumAlgorithm="CRC32C",
                ChecksumType="FULL_OBJECT",
            )["UploadId"]
        number = len(self.parts) + 1
        checksum = _b64_crc(self.part_crc)
        out = self.fs.call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=bytes(self.buf),
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=checksum,
        )
        self.parts.append({"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC32C": checksum})
        self.buf, self.part_crc = bytearray(), 0

    def close(self) -> None:
        """Publish the object (FileExistsError: ``exclusive`` and the name is taken)."""
        if self.closed:
            return
        self.closed = True
        if self.upload_id is None:
            self.fs.call_s3(
                "put_object",
                Bucket=self.bucket,
                Key=self.key,
                Body=bytes(self.buf),
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=_b64_crc(self.crc),
                **self.match,
            )
        else:
            try:
                if self.buf:
                    self._send_part()
                self.fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": self.parts},
                    ChecksumCRC32C=_b64_crc(self.crc),
                    ChecksumType="FULL_OBJECT",
                    **self.match,
                )
            except BaseException:
                self._abort()
                raise
        self.buf = bytearray()
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abandon the upload: no object appears, and the parts sent so far are deleted."""
        self.closed = True
        self.buf = bytearray()
        self._abort()

    def _abort(self) -> None:
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            with contextlib.suppress(Exception):
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id
                )


class RangeFile(io.RawIOBase):
    """A byte range of an object as a seekable read-only file (``Store.open``).

    Every read is a retried ranged read of the store. A small read fetches up to ``_READ_AHEAD``
    bytes and serves the next small reads from them: ``torch.load`` reads a zip file's directory
    in dozens of tiny reads near its end, which would otherwise be as many requests to an object
    store. A large read goes straight into the caller's buffer.
    """

    def __init__(self, store: Store, rel: str, start: int, length: int) -> None:
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
