"""Large objects as parallel parts: S3 multipart PUTs, and ranged GETs with no HEAD (S3; GCS through
:mod:`diloco_serverless.store._gcs`, which supplies its own :data:`RangeRead`).

One request moves ~50-100 MB/s on a real store, far below a replica's NIC, so an object larger than
:attr:`TransferPolicy.part_size` goes up as an S3 multipart upload whose parts are sent
``concurrency`` at a time, and comes down as ranged GETs, ``concurrency`` at a time. Objects up to
``part_size`` stay single requests (a PUT, or one GET).

* **No HEAD before GET.** The first GET asks for ``bytes=0-<part_size - 1>``; its ``Content-Range``
  (``bytes 0-x/<total>``) gives the object's size. As soon as its headers arrive (its body still
  arriving) the other ranges are requested, each with ``If-Match: <etag of the first answer>``. An
  object replaced between two ranges answers 412: the read raises a ``ConnectionError`` (transient,
  :func:`object_changed`), and the caller's retry starts over, so a reader never returns parts of two
  versions. An empty object answers the first range with 416, read as ``b""``.
* **Size bound known: all ranges at once.** A reader that bounds the size (``max_bytes``, as the
  exchange does for every shard object) and allows more than one part sends the ranges covering
  ``[0, max_bytes]`` together, without waiting for the first: ranges past the end answer 416 and are
  empty, and every answer must carry the same ETag and size (else the read restarts, as above).
* **Create-only multipart.** ``put_if_absent`` completes the upload with ``If-None-Match: *``: S3
  answers 412 if the key exists (s3fs raises ``FileExistsError``), exactly like a create-only
  ``PutObject``. An upload that fails is aborted (best effort) so no parts linger.
* **Hedged reads.** Every GET (whole object or range) goes through the store's
  :class:`~diloco_serverless.store.hedge.Hedger`: one that has not answered after the
  :attr:`TransferPolicy.hedge_quantile` of recent answer times is sent again, and the first answer wins.
* **Per-part retries.** A part that fails transiently (503 SlowDown, a dropped connection) is re-sent
  on its own, with the caller's :class:`~diloco_serverless.store.retry.RetryPolicy` backoff, within the
  operation's deadline; other errors abort the whole transfer.

The functions here are coroutines for s3fs's event loop; :class:`~diloco_serverless.store.ObjectStore`
runs them under its retry policy and deadline, and maps their errors.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from diloco_serverless.errors import DilocoError
from diloco_serverless.store.errors import is_range_unsatisfiable, is_transient
from diloco_serverless.store.hedge import HEDGE_QUANTILE, Hedger
from diloco_serverless.store.retry import RetryPolicy

__all__ = [
    "MIN_PART_SIZE",
    "MAX_PARTS",
    "object_changed",
    "RangeAnswer",
    "RangeRead",
    "TransferPolicy",
    "VersionChanged",
    "ranged_get",
    "range_total",
    "s3_reader",
    "s3_put_parts",
]

T = TypeVar("T")
MiB = 1 << 20
#: S3's smallest part (all but the last) of a multipart upload.
MIN_PART_SIZE = 5 * MiB
#: S3's most parts per upload; larger objects get larger parts.
MAX_PARTS = 10_000
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


def object_changed(where: str, detail: str) -> ConnectionError:
    """The error of a read whose object (``where``, its URL) was replaced between two of its ranged GETs:
    a plain ``ConnectionError``, i.e. transient, so the operation's retry reads it again from byte 0."""
    return ConnectionError(f"{where} changed while it was read in parts ({detail}); reading it again")


@dataclass(frozen=True)
class TransferPolicy:
    """How large objects travel (S3; other back ends ignore it).

    Attributes:
        part_size: bytes per part; objects up to this size are one request. At least 5 MiB (S3's
            smallest multipart part).
        concurrency: parts of one object in flight at once (>= 1; 1 still splits, sequentially).
        hedge_quantile: a read (GET or listing) that has not answered after this quantile of the
            store's recent answer times is sent a second time, and the first answer wins
            (:mod:`~diloco_serverless.store.hedge`); ``None`` never sends one. Strictly between 0 and 1.
    """

    part_size: int = 16 * MiB
    concurrency: int = 8
    hedge_quantile: float | None = HEDGE_QUANTILE

    def __post_init__(self) -> None:
        if not isinstance(self.part_size, int) or self.part_size < MIN_PART_SIZE:
            raise ValueError(f"TransferPolicy.part_size must be an int >= {MIN_PART_SIZE} bytes (5 MiB, S3's "
                             f"smallest multipart part), got {self.part_size!r}")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"TransferPolicy.concurrency must be an int >= 1, got {self.concurrency!r}")
        q = self.hedge_quantile
        if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1):
            raise ValueError(f"TransferPolicy.hedge_quantile must be a number strictly between 0 and 1, or None "
                             f"(no hedged reads), got {q!r}")

    @classmethod
    def from_mb(cls, part_size_mb: float, concurrency: int,
                hedge_quantile: float | None = HEDGE_QUANTILE) -> TransferPolicy:
        """From a config's ``part_size_mb`` (MiB), ``part_concurrency`` and ``hedge_quantile``."""
        return cls(part_size=int(part_size_mb * MiB), concurrency=concurrency, hedge_quantile=hedge_quantile)

    def part_size_for(self, size: int) -> int:
        """The part size for an object of ``size`` bytes: :attr:`part_size`, enlarged so that no
        upload needs more than S3's 10,000 parts."""
        return max(self.part_size, -(-size // MAX_PARTS))

    def ranges(self, size: int, start: int = 0) -> list[tuple[int, int]]:
        """``[start, size)`` cut into ``(first, end)`` byte ranges of :meth:`part_size_for` bytes."""
        step = self.part_size_for(size)
        return [(lo, min(lo + step, size)) for lo in range(start, size, step)]


async def _retrying(call: Callable[[], Awaitable[T]], retry: RetryPolicy, deadline: float) -> T:
    """``await call()``, re-trying transient errors with ``retry``'s backoff until its attempts or
    ``deadline`` (``time.monotonic``) run out; the last error propagates."""
    n = 1
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_transient(exc) or n >= retry.max_attempts:
                raise
            pause = retry.delay_s(n)
            if time.monotonic() + pause >= deadline:
                raise
            await asyncio.sleep(pause)
            n += 1


class RangeAnswer(NamedTuple):
    """One ranged GET whose headers have arrived: the object's size (``None`` when the answer does not
    say), the version it came from (an S3 ETag, a GCS generation; ``None`` if unknown), and its body,
    to read (``body()``, which also releases the connection) or to drop unread (``release()``, which
    may be called more than once)."""

    total: int | None
    version: str | None
    body: Callable[[], Awaitable[bytes]]
    release: Callable[[], None]


#: ``read(lo, hi, version)``: bytes ``[lo, hi)`` of one object, only of ``version`` when given (else
#: :class:`VersionChanged`), answered once the headers arrive; an empty object's or a past-the-end range
#: answers 416 (an ``OSError``).
RangeRead = Callable[[int, int, str | None], Awaitable[RangeAnswer]]


class VersionChanged(DilocoError):
    """A ranged GET pinned to a version found another one (412): not transient by itself; the read
    turns it into :func:`object_changed`, which the operation's retry restarts from byte 0."""


def _release(resp: dict[str, Any]) -> None:
    """Close an answer's body unread (the losing request of a hedged GET)."""
    resp["Body"].close()


def _get_object(fs: Any, hedger: Hedger | None, policy: TransferPolicy, **kwargs: Any) -> Awaitable[dict[str, Any]]:
    """One GetObject (headers; the body is read by the caller), hedged when there is a ``hedger``."""
    if hedger is None:
        return fs._call_s3("get_object", **kwargs)  # type: ignore[no-any-return]
    return hedger.first(lambda: fs._call_s3("get_object", **kwargs), quantile=policy.hedge_quantile,
                        release=_release)


async def _read_body(resp: dict[str, Any]) -> bytes:
    body = resp["Body"]
    try:
        return bytes(await body.read())
    finally:
        body.close()


def range_total(content_range: object) -> int | None:
    """Object size from a ranged answer's ``Content-Range`` (``bytes a-b/<total>``); ``None`` without one
    (a server that ignored the range and sent the whole object, or one that does not know the size)."""
    m = _CONTENT_RANGE.match(str(content_range or ""))
    return None if m is None or m.group(3) == "*" else int(m.group(3))


def _is_precondition_failed(exc: BaseException) -> bool:
    cur: BaseException | None = exc
    for _ in range(8):
        if cur is None:
            return False
        response = getattr(cur, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def s3_reader(fs: Any, bucket: str, key: str, policy: TransferPolicy, hedger: Hedger | None) -> RangeRead:
    """Ranged GetObjects of ``s3://bucket/key`` (hedged with ``hedger``), pinned by ``If-Match``."""

    async def read(lo: int, hi: int, version: str | None) -> RangeAnswer:
        match = {"IfMatch": version} if version else {}
        try:
            resp = await _get_object(fs, hedger, policy, Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}",
                                     **match)
        except OSError as exc:
            if version and _is_precondition_failed(exc):
                raise VersionChanged("its ETag no longer matches") from exc
            raise
        return RangeAnswer(range_total(resp.get("ContentRange")), resp.get("ETag"), lambda: _read_body(resp),
                           lambda: _release(resp))

    return read


async def _fetch(read: RangeRead, lo: int, hi: int, version: str | None) -> tuple[bytes, RangeAnswer]:
    """Bytes ``[lo, hi)`` (one GET, headers and body) and its answer."""
    answer = await read(lo, hi, version)
    return await answer.body(), answer


async def ranged_get(read: RangeRead, where: str, policy: TransferPolicy, retry: RetryPolicy, deadline: float,
                     limit: int | None = None, too_large: Callable[[int], BaseException] | None = None) -> bytes:
    """An object's bytes via ranged GETs through ``read`` (see the module docstring); never a HEAD.

    The first range's headers size the object; the other ranges start then, while the first body is
    still arriving. With ``limit``, the first range is at most ``limit + 1`` bytes and an object larger
    than ``limit`` raises ``too_large(size)`` before its body is read. ``where`` names the object in errors.
    """
    if limit is not None and limit + 1 > policy.part_size:
        return await _get_bounded(read, where, policy, retry, deadline, limit, too_large)

    def oversized(total: int) -> BaseException:
        return too_large(total) if too_large is not None else ValueError(f"object larger than {limit} bytes")

    first_len = max(1, policy.part_size if limit is None else min(policy.part_size, limit + 1))
    try:
        first = await _retrying(lambda: read(0, first_len, None), retry, deadline)
    except OSError as exc:
        if is_range_unsatisfiable(exc):
            return b""  # the store's answer to a range of an empty object
        raise
    total = first.total
    if total is not None and limit is not None and total > limit:
        first.release()
        raise oversized(total)
    if total is None or total <= first_len:  # this answer holds the whole object
        head = await first.body()
        total = len(head) if total is None else total
        if limit is not None and total > limit:
            raise oversized(total)
        if len(head) != total:
            raise object_changed(where, f"its first range returned {len(head)} of {total} bytes")
        return head
    out = bytearray(total)
    gate = asyncio.Semaphore(policy.concurrency)

    async def head_part() -> None:  # first in line for the gate: its request is already in flight
        async with gate:
            data = await first.body()
        if len(data) != first_len:
            raise object_changed(where, f"range 0-{first_len - 1} returned {len(data)} bytes")
        out[:first_len] = data

    async def one(lo: int, hi: int) -> None:
        async with gate:
            try:
                data, part = await _retrying(lambda: _fetch(read, lo, hi, first.version), retry, deadline)
            except VersionChanged as exc:
                raise object_changed(where, str(exc)) from exc
        if len(data) != hi - lo or part.total not in (None, total):
            raise object_changed(where, f"range {lo}-{hi - 1} returned {len(data)} bytes of {part.total}")
        out[lo:hi] = data

    try:
        await _gather_all([head_part(), *(one(lo, hi) for lo, hi in policy.ranges(total, start=first_len))])
    finally:
        first.release()  # a no-op once its body was read; closes it if the read failed before
    return bytes(out)


async def _get_bounded(read: RangeRead, where: str, policy: TransferPolicy, retry: RetryPolicy, deadline: float,
                       limit: int, too_large: Callable[[int], BaseException] | None) -> bytes:
    """Every range of ``[0, limit]`` at once (see the module docstring); the object's bytes."""
    spans = policy.ranges(limit + 1)
    got: list[tuple[bytes, int | None, str | None]] = [(b"", None, None)] * len(spans)
    gate = asyncio.Semaphore(policy.concurrency)

    async def one(i: int, lo: int, hi: int) -> None:
        async with gate:
            try:
                data, answer = await _retrying(lambda: _fetch(read, lo, hi, None), retry, deadline)
            except OSError as exc:
                if is_range_unsatisfiable(exc):
                    return  # past the end (or an empty object)
                raise
        # without a Content-Range only an answer from byte 0 says the size: it is the whole object
        got[i] = (data, answer.total if answer.total is not None or lo else len(data), answer.version)

    await _gather_all([one(i, lo, hi) for i, (lo, hi) in enumerate(spans)])
    versions = {version for _, total, version in got if total is not None}
    totals: set[int] = {total for _, total, _ in got if total is not None}
    if len(versions) > 1 or len(totals) > 1:
        raise object_changed(where, "its parts came from different versions")
    total = totals.pop() if totals else 0
    if total > limit:
        raise (too_large(total) if too_large is not None else ValueError(f"object larger than {limit} bytes"))
    data = b"".join(part for part, _, _ in got)[:total]
    if len(data) != total:
        raise object_changed(where, f"{len(data)} of {total} bytes came back")
    return data


async def _gather_all(coros: list[Awaitable[Any]]) -> list[Any]:
    """Run ``coros`` together; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def s3_put_parts(fs: Any, bucket: str, key: str, data: bytes, policy: TransferPolicy, retry: RetryPolicy,
                       deadline: float, *, create_only: bool) -> None:
    """Upload ``data`` as a multipart upload, parts in parallel. With ``create_only`` the completion
    carries ``If-None-Match: *`` and an existing key raises ``FileExistsError`` (from s3fs)."""
    view = memoryview(data)
    mpu = await _retrying(lambda: fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key), retry, deadline)
    upload_id = mpu["UploadId"]
    gate = asyncio.Semaphore(policy.concurrency)

    async def one(number: int, lo: int, hi: int) -> dict[str, Any]:
        async with gate:
            answer = await _retrying(lambda: fs._call_s3(
                "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                Body=bytes(view[lo:hi])), retry, deadline)
        return {"PartNumber": number, "ETag": answer["ETag"]}

    try:
        parts = await _gather_all([one(i + 1, lo, hi) for i, (lo, hi) in enumerate(policy.ranges(len(data)))])
        match = {"IfNoneMatch": "*"} if create_only else {}
        await _retrying(lambda: fs._call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": parts}, **match), retry, deadline)
    except BaseException:
        try:  # best effort: no orphaned parts (a bucket lifecycle rule catches the rest)
            await asyncio.wait_for(fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                                               UploadId=upload_id), timeout=10)
        except Exception:  # noqa: S110 - the original error is what matters
            pass
        raise
    fs.invalidate_cache(f"{bucket}/{key}")
