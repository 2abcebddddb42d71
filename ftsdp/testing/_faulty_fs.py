"""``faulty://``: local files written atomically (as on an object store), crashing where an armed
``crash_in_save`` fault says (``after_data`` n=K, ``before_manifest``, ``before_latest``)."""

from __future__ import annotations

import io
import os
import re
import threading
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from ftsdp.testing._faults import EXIT_INJECTED, Fault, log_fault

PROTOCOL = "faulty"
_DATA = re.compile(r"(?:^|/)step-(\d+)/rank\d+-\d+-[0-9a-f]+\.safetensors$")
_MANIFEST = re.compile(r"(?:^|/)step-(\d+)/manifest\.json$")

_armed: list[Fault] = []
_rank = 0
_incarnation = ""
_written: dict[int, int] = {}  # step -> data objects written by this process
_lock = threading.Lock()


def arm(url: str, faults: list[Fault], rank: int, incarnation: str = "") -> str:
    """Register the filesystem, arm ``faults`` for ``rank`` and return ``url`` as faulty://."""
    global _armed, _rank, _incarnation
    if "://" in url and not url.startswith(("file://", f"{PROTOCOL}://")):
        raise ValueError(f"crash_in_save faults need a local checkpoint directory, got {url!r}")
    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
    _armed, _rank, _incarnation = list(faults), rank, incarnation
    _written.clear()
    path = url.split("://", 1)[1] if "://" in url else url
    return f"{PROTOCOL}://{os.path.abspath(path)}"


def _crash(fault: Fault, path: str) -> None:
    log_fault(fault, _rank, _incarnation, path=path)
    os._exit(EXIT_INJECTED)


class _Writer(io.BytesIO):
    """Buffers an object and commits it atomically on close, crashing where a fault says."""

    def __init__(self, fs: FaultyFileSystem, path: str) -> None:
        super().__init__()
        self._fs, self._path = fs, path

    def discard(self) -> None:
        super().close()

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            self._fs._commit(self._path, data)

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self.discard()
        else:
            self.close()


class FaultyFileSystem(AbstractFileSystem):
    protocol = PROTOCOL
    root_marker = "/"
    cachable = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return LocalFileSystem._strip_protocol(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        return self._local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._local.info(self._strip_protocol(path))

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> bytes:
        return self._local.cat_file(self._strip_protocol(path), start=start, end=end)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = path if isinstance(path, list) else [path]
        for p in paths:
            self._local.rm(self._strip_protocol(p), recursive=recursive)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._local.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._local.makedirs(self._strip_protocol(path), exist_ok=True)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        return _Writer(self, path) if "w" in mode else self._local._open(path, mode)

    def _commit(self, path: str, data: bytes) -> None:
        if manifest := _MANIFEST.search(path):
            self._maybe_crash("before_manifest", int(manifest.group(1)), path)
        if path.endswith("/latest"):
            self._maybe_crash("before_latest", int(data.decode().strip() or -1), path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if data_obj := _DATA.search(path):
            step = int(data_obj.group(1))
            with _lock:
                _written[step] = _written.get(step, 0) + 1
                count = _written[step]
            for fault in _armed:
                if fault.point == "after_data" and fault.step == step and count >= fault.n:
                    _crash(fault, path)

    def _maybe_crash(self, point: str, step: int, path: str) -> None:
        for f in _armed:
            if f.point == point and f.step == step:
                _crash(f, path)
