"""S3 on a real server (SeaweedFS): one answer for a taken name whatever the server says, and
the requests a save and a load cost (docs/format.md, "Requests on S3").

Requests are counted below s3fs, at aiobotocore's ``_make_api_call``: one per S3 API call
(botocore's own retries of a call are not counted again).
"""

from __future__ import annotations

import collections
import re
from typing import Any

import pytest
import torch
from aiobotocore.client import AioBaseClient
from botocore.exceptions import ClientError
from s3fs.errors import translate_boto_error

from ftsdp import storage
from ftsdp.storage.io._fs import Store
from ftsdp.storage.io._s3 import name_taken

Calls = list[tuple[str, str]]  # (operation, key or prefix under the bucket)


def _client_error(status: int, code: str, operation: str = "PutObject") -> OSError:
    """The error s3fs raises for an S3 answer: its OSError, botocore's ClientError the cause."""
    response: Any = {
        "Error": {"Code": code, "Message": f"the server says {code}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    err = translate_boto_error(ClientError(response, operation))
    assert isinstance(err, OSError) and isinstance(err.__cause__, ClientError)
    return err


TAKEN = [(412, "PreconditionFailed"), (409, "ConditionalRequestConflict")]
OTHER = [(403, "AccessDenied"), (500, "InternalError"), (409, "OperationAborted")]


@pytest.mark.parametrize(("status", "code"), TAKEN + OTHER)
def test_only_a_refused_conditional_create_means_the_name_is_taken(status, code) -> None:
    err = _client_error(status, code)
    assert not isinstance(err, FileExistsError)  # s3fs alone would not say so
    assert name_taken(err) == ((status, code) in TAKEN)


@pytest.mark.parametrize("checksums", [True, False], ids=["S3Upload", "s3fs-file"])
@pytest.mark.parametrize(("status", "code"), TAKEN + OTHER)
def test_a_commit_refused_by_the_server_is_a_conflict_only_when_the_name_is_taken(
    s3_bucket_url,
    s3_endpoint,
    monkeypatch: pytest.MonkeyPatch,
    status: int,
    code: str,
    checksums: bool,
) -> None:
    """The manifest's exclusive create answered with ``status``/``code`` (as s3fs wraps it):
    412 and 409 ConditionalRequestConflict make the save lose with CommitConflictError (another
    writer has the step), any other error stays what it is and the step is not committed."""
    io = storage.IOOptions(max_attempts=1, object_checksums=checksums)
    options = storage.SaveOptions(io=io)
    state = {"w": torch.arange(6.0)}
    storage.save(state, s3_bucket_url, step=1, storage_options=s3_endpoint, options=options)
    real = AioBaseClient._make_api_call

    async def refuse_the_manifest(self: Any, operation: str, params: dict) -> Any:
        if params.get("Key", "").endswith("step-2/manifest.json") and operation == "PutObject":
            raise ClientError(
                {
                    "Error": {"Code": code, "Message": f"the server says {code}"},
                    "ResponseMetadata": {"HTTPStatusCode": status},
                },
                operation,
            )
        return await real(self, operation, params)

    monkeypatch.setattr(AioBaseClient, "_make_api_call", refuse_the_manifest)
    with pytest.raises(Exception) as err:
        storage.save(state, s3_bucket_url, step=2, storage_options=s3_endpoint, options=options)
    conflict = isinstance(err.value, storage.CommitConflictError)
    assert conflict == ((status, code) in TAKEN), repr(err.value)
    if not conflict:
        assert not isinstance(err.value, FileExistsError) and code in str(err.value)
    monkeypatch.undo()
    assert storage.list_steps(s3_bucket_url, storage_options=s3_endpoint) == [1]


def test_write_exclusive_maps_a_real_servers_refusal(s3_bucket_url, s3_endpoint) -> None:
    """SeaweedFS answers 412 PreconditionFailed without naming the condition (s3fs: EINVAL)."""
    store = Store(s3_bucket_url, s3_endpoint, storage.IOOptions(max_attempts=1))
    store.write_exclusive("a", b"first")
    with pytest.raises(FileExistsError) as err:
        store.write_exclusive("a", b"second")
    assert name_taken(err.value.__cause__)  # the server's own answer, kept as the cause
    assert store.read("a") == b"first"


# -- requests -------------------------------------------------------------------------------------


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Every S3 API call of this process, as (operation, key or prefix)."""
    seen: Calls = []
    real = AioBaseClient._make_api_call

    async def record(self: Any, operation: str, params: dict) -> Any:
        deleted = params.get("Delete", {}).get("Objects") or [{}]  # DeleteObjects: the first
        key = params.get("Key") or params.get("Prefix") or deleted[0].get("Key", "")
        seen.append((operation, key))
        return await real(self, operation, params)

    monkeypatch.setattr(AioBaseClient, "_make_api_call", record)
    return seen


_STEP = re.compile(r"step-(\d+)/")


def _split(calls: Calls, retired: set[int]) -> tuple[int, int, Calls]:
    """``(data, on retired steps, the rest)`` of one save's or load's requests."""
    on_retired = [c for c in calls if (m := _STEP.search(c[1])) and int(m.group(1)) in retired]
    others = [c for c in calls if c not in on_retired]
    data = sum(key.endswith(".safetensors") for _, key in others)
    return data, len(on_retired), [c for c in others if not c[1].endswith(".safetensors")]


def test_a_save_costs_its_objects_and_a_constant_number_of_requests(
    s3_bucket_url,
    s3_endpoint,
    calls: Calls,
) -> None:
    """Ten saves with retention (keep_last=2, keep_every=3: the kept steps grow). From the 2nd
    save on, each costs its one object, the same metadata requests, and a constant number per
    step it retires; no manifest is read but the retired one's (checked before it is deleted).
    A load costs the same after 2 steps as after 10."""
    url, opts = s3_bucket_url, s3_endpoint
    state = {"w": torch.randn(64, 64), "b": torch.arange(10.0)}
    options = storage.SaveOptions(keep_last=2, keep_every=3)
    steps: list[int] = []
    rests, per_retired, loads = [], [], []
    for step in range(1, 11):
        calls.clear()
        storage.save(state, url, step=step, storage_options=opts, options=options)
        saved = list(calls)
        before, steps = steps, storage.list_steps(url, storage_options=opts)
        retired = set(before) - set(steps)
        data, on_retired, rest = _split(saved, retired)
        assert data == 1, saved  # one object: one PutObject
        assert not [c for c in rest if c[0] in ("GetObject", "HeadObject")], rest
        rests.append(collections.Counter(op for op, _ in rest))
        if retired:
            per_retired.append(on_retired / len(retired))
        if step in (2, 10):
            calls.clear()
            target = {"w": torch.zeros(64, 64), "b": torch.zeros(10)}
            storage.load(target, url, storage_options=opts)
            assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
            data, _, rest = _split(calls, set())
            loads.append((data, collections.Counter(op for op, _ in rest)))
    assert steps == [3, 6, 9, 10]
    assert all(r == rests[1] for r in rests[1:]), rests  # the 2nd save's, to the 10th
    assert sum(rests[1].values()) <= 6, rests[1]  # listings, the manifest, ``latest``
    assert len(per_retired) >= 5 and len(set(per_retired)) == 1, per_retired
    assert loads[0] == loads[1] and loads[0][0] == 1, loads


def test_deletes_a_policy_refuses_are_errors_not_removals(
    s3_bucket_url, s3_endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket policy that allows writes but not deletes (a common no-delete policy): S3
    answers DeleteObjects with HTTP 200 and a refusal per key, which s3fs drops, and a single
    DELETE with 403 AccessDenied. gc reports each refusal, not the steps as removed, and every
    step is still there and loads."""
    from ftsdp.storage import catalog

    opts = s3_endpoint
    for step in (1, 2, 3):
        storage.save(
            {"w": torch.full((4,), float(step))}, s3_bucket_url, step, storage_options=opts
        )
    real = AioBaseClient._make_api_call

    async def no_deletes(self: Any, operation: str, params: dict) -> Any:
        if operation == "DeleteObjects":  # as S3 answers: 200, the refusals listed per key
            keys = [o["Key"] for o in params["Delete"]["Objects"]]
            return {"Errors": [{"Key": k, "Code": "AccessDenied", "Message": "no"} for k in keys]}
        if operation == "DeleteObject":
            error = {"Code": "AccessDenied", "Message": "no deletes here"}
            raise ClientError(
                {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 403}}, operation
            )
        return await real(self, operation, params)

    monkeypatch.setattr(AioBaseClient, "_make_api_call", no_deletes)
    report = catalog.collect_garbage(s3_bucket_url, keep_last=1, storage_options=opts)
    assert report.removed_steps == [] and report.removed_paths == []
    assert len(report.failed) == 2 and all("step-" in f for f in report.failed), report.failed
    monkeypatch.undo()
    assert storage.list_steps(s3_bucket_url, storage_options=opts) == [1, 2, 3]
    for step in (1, 2, 3):
        got = storage.load_state_dict(s3_bucket_url, step, storage_options=opts)
        assert torch.equal(got["w"], torch.full((4,), float(step)))


@pytest.mark.parametrize("tail", ["a//b", "/a", "a//"])
def test_a_key_prefix_with_an_empty_segment_is_refused_before_anything_is_written(
    s3_bucket_url, s3_endpoint, tail: str
) -> None:
    """``s3://bucket/a//b``: SeaweedFS (like MinIO) folds ``//`` into one slash, AWS keeps it,
    so a save wrote its objects under one key and looked for them under another (it failed
    and left an orphan object), and loads found nothing. Refused by every call, nothing made.
    (A trailing ``//`` is only the root's end, as a trailing ``/`` is.)"""
    import s3fs

    url = f"{s3_bucket_url}/{tail}"
    if tail == "a//":
        storage.save({"w": torch.ones(2)}, url, 1, storage_options=s3_endpoint)
        assert storage.list_steps(url, storage_options=s3_endpoint) == [1]
        return
    for call in (
        lambda: storage.save({"w": torch.ones(2)}, url, 1, storage_options=s3_endpoint),
        lambda: storage.list_steps(url, storage_options=s3_endpoint),
        lambda: storage.load_state_dict(url, storage_options=s3_endpoint),
    ):
        with pytest.raises(ValueError, match="empty path segment"):
            call()
    fs = s3fs.S3FileSystem(**s3_endpoint)
    bucket = s3_bucket_url.removeprefix("s3://").split("/")[0]
    assert fs.find(bucket) == []


def test_credentials_the_server_refuses_are_errors_and_change_nothing(
    s3_bucket_url, s3_endpoint
) -> None:
    """On the real server, which checks credentials: a wrong secret cannot list, save or load;
    credentials that may only read and list load every step, and their save and their gc are
    refused (the gc's deletes each reported) with every step still there."""
    from ftsdp.storage import catalog
    from ftsdp.testing._seaweedfs import READER

    for step in (1, 2):
        storage.save(
            {"w": torch.full((3,), float(step))}, s3_bucket_url, step, storage_options=s3_endpoint
        )
    wrong = {**s3_endpoint, "secret": "not-the-secret"}
    with pytest.raises(PermissionError):
        storage.list_steps(s3_bucket_url, storage_options=wrong)
    with pytest.raises(PermissionError):
        storage.load_state_dict(s3_bucket_url, storage_options=wrong)
    reader = {**s3_endpoint, **READER}
    assert storage.list_steps(s3_bucket_url, storage_options=reader) == [1, 2]
    got = storage.load_state_dict(s3_bucket_url, 1, storage_options=reader)
    assert torch.equal(got["w"], torch.full((3,), 1.0))
    with pytest.raises(PermissionError):
        storage.save({"w": torch.zeros(3)}, s3_bucket_url, 3, storage_options=reader)
    report = catalog.collect_garbage(s3_bucket_url, keep_last=1, storage_options=reader)
    assert report.removed_steps == [] and len(report.failed) == 1, report
    assert storage.list_steps(s3_bucket_url, storage_options=s3_endpoint) == [1, 2]
    assert catalog.verify(s3_bucket_url, storage_options=s3_endpoint).ok


def test_a_listing_is_not_kept_once_read(s3_bucket_url, s3_endpoint) -> None:
    """Every listing is read fresh (other processes write the root), so none is kept: s3fs's
    cache of listings grew by every step a rank listed, for the life of the process."""
    from ftsdp.storage.io._fs import Store

    storage.save({"w": torch.zeros(3)}, s3_bucket_url, 1, storage_options=s3_endpoint)
    store = Store(s3_bucket_url, s3_endpoint)
    assert "step-1" in store.listdir() and store.listdir("step-1")
    assert not [k for k in store.fs.dircache if k.startswith(store.root)], list(store.fs.dircache)
