"""Errors raised by :class:`diloco_serverless.store.ObjectStore`, and the one place where the
exceptions of fsspec back ends (s3fs, gcsfs, the local and memory file systems, botocore,
aiohttp, requests) are translated into them.

Modelled on s3fs's ``translate_boto_error``: cloud errors are classified in one function, and
only a declared set of transient errors (:data:`TRANSIENT_ERRORS`, :data:`TRANSIENT_ERRNOS`,
:data:`TRANSIENT_S3_CODES`, :data:`TRANSIENT_HTTP_STATUS`) is ever retried.
Every :class:`StoreError` names the operation, the store URL and the key.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import Any

from diloco_serverless.errors import StoreError

__all__ = [
    "StoreError",
    "ObjectNotFound",
    "StoreAccessDenied",
    "StoreUnavailable",
    "ObjectTooLarge",
    "TRANSIENT_ERRORS",
    "TRANSIENT_ERRNOS",
    "TRANSIENT_S3_CODES",
    "TRANSIENT_HTTP_STATUS",
    "is_transient",
    "is_range_unsatisfiable",
    "is_access_denied",
    "translate_error",
]


class ObjectNotFound(StoreError, FileNotFoundError):
    """The object (or the bucket holding it) does not exist."""


class StoreAccessDenied(StoreError, PermissionError):
    """The credentials in use may not perform the operation (HTTP 401/403, EACCES)."""


class StoreUnavailable(StoreError, ConnectionError):
    """The store could not be reached, or kept failing transiently, until retries or the
    deadline (:attr:`RetryPolicy.timeout_s`) ran out."""


def _optional_types() -> tuple[type[BaseException], ...]:
    """Transient exception types of optional back ends, when those are installed."""
    found: list[type[BaseException]] = []
    try:
        from fsspec.exceptions import FSTimeoutError

        found.append(FSTimeoutError)
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        pass
    try:
        import botocore.exceptions as bex

        found += [bex.ConnectionError, bex.HTTPClientError, bex.ConnectionClosedError]
        found += [bex.ReadTimeoutError, bex.ConnectTimeoutError, bex.EndpointConnectionError]
        found += [bex.ResponseStreamingError, bex.IncompleteReadError]
    except (ImportError, AttributeError):  # pragma: no cover - s3 extra absent
        pass
    try:  # the rest of s3fs.core.S3_RETRYABLE_ERRORS (we run s3fs with retries=1)
        from botocore.parsers import ResponseParserError
        from urllib3.exceptions import IncompleteRead

        found += [ResponseParserError, IncompleteRead]
    except ImportError:  # pragma: no cover
        pass
    try:
        import aiohttp

        found.append(aiohttp.ClientConnectionError)
        found.append(aiohttp.ClientPayloadError)
    except ImportError:  # pragma: no cover
        pass
    try:
        import requests.exceptions as rex

        found += [rex.ConnectionError, rex.Timeout, rex.ChunkedEncodingError]
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


#: Exception types that are always transient: retried with capped backoff.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
    socket.timeout,
    asyncio.TimeoutError,
) + _optional_types()

#: ``OSError.errno`` values that are transient. s3fs maps HTTP 500 to EREMOTEIO and
#: 503/SlowDown to EBUSY (``s3fs.errors.ERROR_CODE_TO_EXCEPTION``).
TRANSIENT_ERRNOS: frozenset[int] = frozenset(
    {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
     getattr(errno, "EREMOTEIO", 121)}
)

#: S3 error codes (botocore ``ClientError``) that are transient. ConditionalRequestConflict
#: is S3's answer (409) when two conditional writes to one key race: retry, then one of
#: them sees PreconditionFailed.
TRANSIENT_S3_CODES: frozenset[str] = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
     "ThrottlingException", "ConditionalRequestConflict", "500", "502", "503", "504"}
)

#: HTTP statuses (gcsfs ``HttpError.code``) that are transient, as in gcsfs.retry.errs.
TRANSIENT_HTTP_STATUS: frozenset[int] = frozenset({408, 429, 500, 501, 502, 503, 504})

_DENIED_S3_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
     "AccountProblem", "ExpiredToken", "InvalidToken", "403", "401"}
)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes/contexts, outermost first (bounded, cycle-safe)."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _s3_code(exc: BaseException) -> str | None:
    response: Any = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def _http_status(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)  # gcsfs.retry.HttpError
    if isinstance(code, int):
        return code
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    return status if isinstance(status, int) else None


def is_access_denied(exc: BaseException) -> bool:
    """True if ``exc`` (or its cause) is an authorisation failure."""
    for e in _chain(exc):
        if isinstance(e, PermissionError):
            return True
        if _s3_code(e) in _DENIED_S3_CODES:
            return True
        if type(e).__name__ in ("HttpError", "ClientResponseError") and _http_status(e) in (401, 403):
            return True
        if type(e) is OSError and str(e).startswith("Forbidden:"):  # gcsfs 403
            return True
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError",
                                "DefaultCredentialsError"):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` belongs to the declared transient set (and is not a denial)."""
    if isinstance(exc, (StoreError, FileNotFoundError, FileExistsError)) or is_access_denied(exc):
        return False
    for e in _chain(exc):
        if isinstance(e, TRANSIENT_ERRORS):
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        if _s3_code(e) in TRANSIENT_S3_CODES:
            return True
        if type(e).__name__ == "HttpError" and _http_status(e) in TRANSIENT_HTTP_STATUS:
            return True
    return False


def translate_error(exc: BaseException, *, url: str, key: str, op: str) -> StoreError:
    """Map a back-end exception to a :class:`StoreError` subclass naming ``op``, URL and key.

    Transient errors map to :class:`StoreUnavailable` (the caller has already retried them).
    """
    if isinstance(exc, StoreError):
        return exc
    where = f"{url}/{key}" if key else url
    detail = f"{type(exc).__name__}: {exc}".strip()
    if isinstance(exc, FileNotFoundError):
        what = ("the bucket does not exist; create it (see infra/) or fix the store URL"
                if op.startswith("put") else "no such object (or no such bucket)")
        return ObjectNotFound(f"{op} {where}: {what} [{detail}]", url=url, key=key, op=op)
    if is_access_denied(exc):
        return StoreAccessDenied(
            f"{op} {where}: access denied; check the credentials (env or storage_options) "
            f"grant this operation on {url} [{detail}]", url=url, key=key, op=op)
    if is_transient(exc):
        return StoreUnavailable(
            f"{op} {where}: store unreachable or failing after retries; check the endpoint "
            f"and network, or raise the deadline (--store-timeout, the run config's store_timeout_s, "
            f"RetryPolicy.timeout_s) [{detail}]", url=url, key=key, op=op)
    return StoreError(f"{op} {where} failed [{detail}]", url=url, key=key, op=op)


class ObjectTooLarge(StoreError):
    """An object is larger than the ``max_bytes`` its reader allowed; it was not read in full.

    Not transient (never retried). ``max_bytes`` is the limit that was exceeded."""

    def __init__(self, message: str, *, url: str = "", key: str = "", op: str = "", max_bytes: int = 0) -> None:
        super().__init__(message, url=url, key=key, op=op)
        self.max_bytes = max_bytes


def is_range_unsatisfiable(exc: BaseException) -> bool:
    """True if ``exc`` is S3's/GCS's answer (416, ``InvalidRange``) to a ranged read from byte 0,
    which is how they say the object is empty."""
    return any(_s3_code(e) == "InvalidRange" or _http_status(e) == 416 for e in _chain(exc))
