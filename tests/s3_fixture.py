"""A real S3-protocol endpoint on 127.0.0.1 (moto's server), the way s3fs's own tests do it.

``s3_endpoint`` (session-scoped) starts ``moto.server.ThreadedMotoServer`` on a free port and
returns ``storage_options`` for s3fs; ``s3_bucket_url`` makes a fresh bucket per test.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ftsdp.testing import free_port


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[dict[str, Any]]:
    """``storage_options`` (endpoint_url, key, secret) of a moto S3 server for this session."""
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
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**storage_options).mkdir(bucket)
    return f"s3://{bucket}/ckpt"


@pytest.fixture
def s3_bucket_url(s3_endpoint: dict[str, Any]) -> Iterator[str]:
    """``s3://<fresh bucket>/ckpt`` on the session's endpoint."""
    import s3fs

    yield new_bucket_url(s3_endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
