"""Retry known-transient I/O errors with capped exponential backoff; everything else raises."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TypeVar

from ftsdp.storage._options import IOOptions

T = TypeVar("T")

_TRANSIENT_CODES = {
    "Throttling",
    "ThrottlingException",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
}


def _botocore_transient(err: BaseException) -> bool:
    # A botocore error exists only once botocore is imported (a local root never imports it).
    if "botocore.exceptions" not in sys.modules:
        return False
    from botocore.exceptions import ClientError, ConnectionError, ReadTimeoutError

    if isinstance(err, (ConnectionError, ReadTimeoutError)):
        return True
    if isinstance(err, ClientError):
        return str(err.response.get("Error", {}).get("Code")) in _TRANSIENT_CODES
    return False


def is_transient(err: BaseException) -> bool:
    """True for errors worth retrying: connection drops, timeouts, throttling, 5xx."""
    cause: BaseException | None = err
    seen = 0
    while cause is not None and seen < 5:  # s3fs wraps boto errors in OSError; look at the cause
        if isinstance(cause, (ConnectionError, TimeoutError)) or _botocore_transient(cause):
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return False


def retry(io: IOOptions, fn: Callable[[], T], *, sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``fn`` until it succeeds, a non-transient error occurs, or attempts run out."""
    delay = io.backoff_s
    for _ in range(io.max_attempts - 1):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
        sleep(delay)
        delay = min(delay * 2, io.backoff_cap_s)
    return fn()  # the last attempt: its error raises, whatever it is
