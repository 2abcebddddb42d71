"""The store on S3 (s3fs): ranged reads streamed into the caller's buffer, conditional creates and
CRC-32C checksummed uploads (docs/format.md, "Integrity"); ``S3Upload`` calls the S3 API itself
because s3fs's file drops the parts' checksums of a multipart upload."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any

from crc32c import crc32c  # the checksum S3 verifies on upload (x-amz-checksum-crc32c)

from ftsdp.storage.io._fs import Store

_CHUNK = 1 << 20  # the most a ranged read holds beside the caller's buffer
_PARTS_IN_FLIGHT = 4  # parts of one multipart upload sent at once (each held until it is sent)

# The answers to a conditional create (If-None-Match: *) whose name is taken, as AWS documents
# them: 412 PreconditionFailed (an object has the name), 409 ConditionalRequestConflict (another
# conditional write of the name is in flight).
_TAKEN_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}


def name_taken(err: BaseException) -> bool:
    """Whether ``err`` (s3fs's OSError, with botocore's ClientError as its ``__cause__``) is the
    server refusing a conditional create because the name is taken. s3fs makes this answer a
    FileExistsError only when the server names the condition (moto does, SeaweedFS does not)."""
    for e in (err, err.__cause__):
        if isinstance(e, FileExistsError):
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in _TAKEN_CODES or status == 412
    return False


class S3Store(Store):
    """A ``Store`` on S3: exclusive creates are native, uploads checksummed (``S3Upload``)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, io: Any = None) -> None:
        super().__init__(url, storage_options, io)
        key = self.fs.split_path(self.root)[1]
        if key.startswith("/") or "//" in key:
            raise ValueError(
                f"{self.url}: the key prefix {key!r} has an empty path segment ('//'), which "
                "S3 servers keep (AWS) or fold into one slash (SeaweedFS, MinIO), so its objects "
                "would be written under one name and looked for under another; give the prefix "
                "without it"
            )

    @staticmethod
    def _serves(fs: Any) -> bool:
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        return bool(protocols & {"s3", "s3a"})

    def _creates_exclusively(self) -> bool:
        return True

    def remove(self, rel: str) -> None:
        """Delete object ``rel`` with a DELETE of its own, whose refusal raises (PermissionError
        for AccessDenied). s3fs deletes through DeleteObjects and drops the refusals that answer
        lists per key, so under a policy that allows writes but not deletes a retention or a gc
        said the objects were gone, and they were not."""
        bucket, key, _ = self.fs.split_path(self.full(rel))
        self._delete(bucket, key, rel)

    def _delete(self, bucket: str, key: str, rel: str) -> None:
        """One DELETE of ``key`` (absent already: nothing to do); the caches of ``rel`` dropped."""
        with contextlib.suppress(FileNotFoundError):
            self._retry(lambda: self.fs.call_s3("delete_object", Bucket=bucket, Key=key))
        self.fs.invalidate_cache(self.full(rel))
        self.invalidate(self._parent(rel))

    def remove_empty_dir(self, rel: str) -> bool:
        """Remove the directory ``rel`` if it is empty: its marker object, where the server keeps
        one (SeaweedFS lists an emptied directory until its ``<key>/`` object is deleted)."""
        bucket, key, _ = self.fs.split_path(self.full(rel))
        if not key:  # the bucket itself
            return super().remove_empty_dir(rel)
        if self.listdir(rel):
            return False
        self._delete(bucket, f"{key}/", rel)
        return True

    @contextlib.contextmanager
    def _atomic_write(self, path: str, exclusive: bool = False) -> Iterator[IO[bytes]]:
        # One answer for a taken name on every server: FileExistsError, as on a local disk
        # (the commit turns it into CommitConflictError).
        try:
            with super()._atomic_write(path, exclusive) as f:
                yield f
        except OSError as e:
            if not exclusive or isinstance(e, FileExistsError) or not name_taken(e):
                raise
            raise FileExistsError(
                f"{path} already exists (the server refused to create it: {e})"
            ) from e

    def _read_at(self, rel: str, start: int, view: memoryview) -> int:
        # One GET whose body streams into ``view``: no second copy of the range is ever held.
        # It runs on the filesystem's event loop, so every thread shares its connection pool.
        from fsspec.asyn import sync

        return int(sync(self.fs.loop, self._get_into, self.full(rel), start, view))

    async def _get_into(self, path: str, start: int, view: memoryview) -> int:
        bucket, key, version = self.fs.split_path(path)
        extra = {"VersionId": version} if version else {}
        resp = await self.fs._call_s3(
            "get_object",
            Bucket=bucket,
            Key=key,
            Range=f"bytes={start}-{start + len(view) - 1}",
            **extra,
        )
        body, got = resp["Body"], 0
        try:
            while got < len(view):
                chunk = await body.read(min(_CHUNK, len(view) - got))
                if not chunk:
                    break
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
        finally:
            body.close()
        return got

    def _upload(self, path: str, part_bytes: int, exclusive: bool) -> Any:
        if self.io.object_checksums:
            return S3Upload(self.fs, path, part_bytes, exclusive)
        return super()._upload(path, part_bytes, exclusive)


def _b64_crc(value: int) -> str:
    """A CRC-32C as S3 spells it: the 4 bytes big-endian, base64."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()


class S3Upload:
    """A write-only file uploading one S3 object with CRC-32C checksums: one ``put_object``, or a
    multipart upload of ``part_bytes`` parts, ``_PARTS_IN_FLIGHT`` sent at once while the next ones
    are written. ``close()`` publishes it (``exclusive``: only if the name is free; the server's
    refusal is mapped by ``S3Store``); ``discard()`` aborts, so nothing appears."""

    def __init__(self, fs: Any, path: str, part_bytes: int, exclusive: bool) -> None:
        self.fs, self.path, self.part_bytes = fs, path, part_bytes
        self.bucket, self.key, _ = fs.split_path(path)
        self.match = {"IfNoneMatch": "*"} if exclusive else {}
        self.buf = bytearray()
        self.size = 0
        self.crc = 0  # of the whole object so far
        self.part_crc = 0  # of the bytes in ``buf``
        self.upload_id: str | None = None
        self.sending: list[tuple[int, str, Future]] = []  # (part number, checksum, upload_part)
        self.pool: ThreadPoolExecutor | None = None
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

    def _call(self, operation: str, **kwargs: Any) -> Any:
        return self.fs.call_s3(operation, Bucket=self.bucket, Key=self.key, **kwargs)

    def _send_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = self._call(
                "create_multipart_upload", ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT"
            )["UploadId"]
        number = len(self.sending) + 1
        checksum = _b64_crc(self.part_crc)
        if len(self.sending) >= _PARTS_IN_FLIGHT:  # wait for room (and raise a failed part's error)
            self.sending[-_PARTS_IN_FLIGHT][2].result()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(_PARTS_IN_FLIGHT, "storage-s3-part")
        sent = self.pool.submit(
            self._call,
            "upload_part",
            UploadId=self.upload_id,
            PartNumber=number,
            Body=bytes(self.buf),
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=checksum,
        )
        self.sending.append((number, checksum, sent))
        self.buf, self.part_crc = bytearray(), 0

    def close(self) -> None:
        """Publish the object (``exclusive``: the server refuses when the name is taken)."""
        if self.closed:
            return
        self.closed = True
        if self.upload_id is None:
            self._call(
                "put_object",
                Body=bytes(self.buf),
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=_b64_crc(self.crc),
                **self.match,
            )
        else:
            try:
                if self.buf:
                    self._send_part()
                parts = [  # every part sent (the first error raises)
                    {"PartNumber": n, "ETag": f.result()["ETag"], "ChecksumCRC32C": c}
                    for n, c, f in self.sending
                ]
                self._call(
                    "complete_multipart_upload",
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                    ChecksumCRC32C=_b64_crc(self.crc),
                    ChecksumType="FULL_OBJECT",
                    **self.match,
                )
            except BaseException:
                self._abort()
                raise
        self.buf = bytearray()
        if self.pool is not None:
            self.pool.shutdown()
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abandon the upload: no object appears, and the parts sent so far are deleted."""
        self.closed = True
        self.buf = bytearray()
        self._abort()

    def _abort(self) -> None:
        if self.pool is not None:  # no part may land after the abort
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", UploadId=upload_id)
