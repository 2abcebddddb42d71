"""S3 uploads carry their CRC-32C as S3's own checksum (``x-amz-checksum-crc32c``), checked
against a real S3 server (SeaweedFS) and the ``crc32c`` package: every request's body, and the whole object's
value that S3 keeps (a multipart upload's ``FULL_OBJECT`` one included)."""

from __future__ import annotations

import base64
from typing import Any

import crc32c
import pytest
import s3fs
import torch

from ftsdp import storage
from ftsdp.storage.io._fs import Store

PARTS = storage.SaveOptions(io=storage.IOOptions(part_bytes=5 << 20))  # S3's smallest part


def b64(data: bytes) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every S3 request s3fs makes, as (operation, parameters)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    real = s3fs.S3FileSystem.call_s3  # the blocking form, which uploads use

    def record(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((method, kwargs))
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", record)
    return seen


def _objects(url: str, opts: dict) -> tuple[s3fs.S3FileSystem, list[str]]:
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    root = url.removeprefix("s3://")
    return fs, sorted(fs.find(root))


def test_every_upload_carries_the_crc32c_s3_keeps(s3_bucket_url, s3_endpoint, calls) -> None:
    state = {"big": torch.randn(7 << 18), "small": torch.arange(10.0)}  # 7 MiB: two parts
    storage.save(state, s3_bucket_url, step=1, storage_options=s3_endpoint, options=PARTS)

    fs, names = _objects(s3_bucket_url, s3_endpoint)
    assert any(n.endswith("manifest.json") for n in names)
    heads = {}
    for name in names:  # what S3 holds: the CRC-32C of the object's bytes, as read back
        bucket, key = name.split("/", 1)
        heads[key] = fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert heads[key].get("ChecksumCRC32C") == b64(fs.cat(name)), name

    # every body went with its own CRC-32C, the parts' again in the completion
    sent = {}
    for method, kw in calls:
        if method in ("put_object", "upload_part"):
            assert kw["ChecksumCRC32C"] == b64(kw["Body"]), method
            sent[(kw["Key"], kw.get("PartNumber"))] = kw["ChecksumCRC32C"]
    completions = [kw for method, kw in calls if method == "complete_multipart_upload"]
    assert completions, "no object was uploaded in parts"
    for kw in completions:
        # the whole object's CRC-32C, not a checksum of the parts' checksums
        assert heads[kw["Key"]]["ChecksumType"] == "FULL_OBJECT"
        parts = kw["MultipartUpload"]["Parts"]
        assert len(parts) == 2
        for p in parts:
            assert p["ChecksumCRC32C"] == sent[(kw["Key"], p["PartNumber"])]
    target = {k: torch.empty_like(v) for k, v in state.items()}
    storage.load(target, s3_bucket_url, storage_options=s3_endpoint)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_a_failed_multipart_write_leaves_no_object_and_no_parts(s3_bucket_url, s3_endpoint) -> None:
    store = Store(s3_bucket_url, s3_endpoint, storage.IOOptions(part_bytes=5 << 20, max_attempts=1))

    def produce(f: Any) -> None:
        f.write(b"x" * (6 << 20))  # one part sent
        raise RuntimeError("the writer died")

    with pytest.raises(RuntimeError, match="the writer died"):
        store.write("step-1/obj", produce)
    fs, names = _objects(s3_bucket_url, s3_endpoint)
    assert names == []
    bucket = s3_bucket_url.removeprefix("s3://").split("/")[0]
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []


def test_checksums_can_be_turned_off_for_stores_that_refuse_them(
    s3_bucket_url,
    s3_endpoint,
    calls,
) -> None:
    off = storage.SaveOptions(io=storage.IOOptions(object_checksums=False))
    storage.save(
        {"w": torch.ones(4)}, s3_bucket_url, step=1, storage_options=s3_endpoint, options=off
    )
    puts = [kw for method, kw in calls if method == "put_object"]
    assert puts and not any("ChecksumCRC32C" in kw for kw in puts)
    target = {"w": torch.zeros(4)}
    storage.load(target, s3_bucket_url, storage_options=s3_endpoint)
    assert torch.equal(target["w"], torch.ones(4))
