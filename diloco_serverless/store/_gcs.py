"""Large objects on GCS as parallel parts: ranged GETs with no metadata request, composite uploads.

gcsfs reads an object with one GET (one connection's stream, ~50-100 MB/s) and, for a ranged read
of unknown length, first asks for its metadata. Here every GCS read goes through
:func:`~diloco_serverless.store._transfer.ranged_get`, as on S3: the first GET asks for
``bytes=0-<part_size - 1>``, its ``Content-Range`` gives the size, and the other ranges follow
``concurrency`` at a time, each with ``ifGenerationMatch=<x-goog-generation of the first answer>``.
An object replaced in between answers 412 (gcsfs raises ``FileExistsError``): the read restarts and
returns the new object whole. A server that sends no generation (an emulator) gets unpinned ranges,
and every answer must still report the first one's size. Each GET is hedged by the store's
:class:`~diloco_serverless.store.hedge.Hedger` until its response headers arrive, as on S3 (gcsfs's
own ``_call`` reads the whole body before it returns, so hedging it would time, and could send
twice, the transfer itself). Retries are the caller's (``ranged_get``), not gcsfs's.

gcsfs writes an object with one upload (a sequential resumable upload above 50 MiB). An object over
the part size goes up here as a parallel composite upload (:func:`gcs_put_parts`): parts as temporary
objects, uploaded ``concurrency`` at a time, one ``compose`` (``ifGenerationMatch=0`` when create-only),
then the parts deleted. GCS has no multipart upload in its JSON API; its XML API has one, which
gcsfs does not speak.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from diloco_serverless.store._transfer import (
    RangeAnswer,
    RangeRead,
    TransferPolicy,
    VersionChanged,
    _gather_all,
    _retrying,
    range_total,
)
from diloco_serverless.store.hedge import Hedger
from diloco_serverless.store.retry import RetryPolicy

__all__ = ["MAX_COMPOSE_SOURCES", "PART_SUFFIX", "gcs_put_parts", "gcs_reader"]

#: GCS composes at most 32 source objects in one request.
MAX_COMPOSE_SOURCES = 32
#: Name ending of a composite upload's temporary parts (a bucket lifecycle rule can match it:
#: infra/gcp/main.tf deletes leftovers after a day).
PART_SUFFIX = ".diloco-part"


async def _open(fs: Any, url: str, headers: dict[str, str], params: dict[str, str]) -> Any:
    """One media GET through gcsfs's session, returned once its headers arrived (the body is the
    caller's to read and release). An error status raises what gcsfs raises for it."""
    from gcsfs.retry import validate_response

    await fs._set_session()
    resp = await fs.session.request("GET", url, params=fs._get_params(params), headers=fs._get_headers(headers),
                                    timeout=fs.requests_timeout)
    if resp.status >= 400:
        try:
            validate_response(resp.status, await resp.read(), url)
        finally:
            resp.release()
    return resp


def gcs_reader(fs: Any, path: str, policy: TransferPolicy, hedger: Hedger | None) -> RangeRead:
    """Ranged media GETs of ``path`` (``bucket/key``) through gcsfs ``fs``, hedged with ``hedger`` up to
    their response headers (a backup never doubles a body that is already arriving)."""
    url = fs.url(path)

    async def read(lo: int, hi: int, version: str | None) -> RangeAnswer:
        pin = {"ifGenerationMatch": version} if version else {}
        headers = {"Range": f"bytes={lo}-{hi - 1}"}
        try:
            if hedger is None:
                resp = await _open(fs, url, headers, pin)
            else:
                resp = await hedger.first(lambda: _open(fs, url, headers, pin), quantile=policy.hedge_quantile,
                                          release=lambda r: r.release())
        except FileExistsError as exc:  # gcsfs's name for 412 Precondition Failed
            if version:
                raise VersionChanged(f"its generation is no longer {version}") from exc
            raise

        async def body() -> bytes:
            try:
                return bytes(await resp.read())
            finally:
                resp.release()

        return RangeAnswer(range_total(resp.headers.get("Content-Range")), resp.headers.get("x-goog-generation"),
                           body, resp.release)

    return read


def compose_ranges(size: int, policy: TransferPolicy) -> list[tuple[int, int]]:
    """``[0, size)`` cut into parts of :attr:`TransferPolicy.part_size`, larger when the object would
    need more than :data:`MAX_COMPOSE_SOURCES` of them."""
    step = max(policy.part_size, -(-size // MAX_COMPOSE_SOURCES))
    return [(lo, min(lo + step, size)) for lo in range(0, size, step)]


async def gcs_put_parts(fs: Any, path: str, data: bytes, temp_prefix: str, policy: TransferPolicy,
                        retry: RetryPolicy, deadline: float, *, create_only: bool) -> None:
    """A parallel composite upload of ``data`` to ``path`` (``bucket/key``): the parts go up
    ``concurrency`` at a time as temporary objects under ``temp_prefix`` (``bucket/...``), one ``compose``
    request joins them into ``path``, and the parts are deleted (also when the upload fails; best
    effort). With ``create_only`` the compose carries ``ifGenerationMatch=0``, so an existing object at
    ``path`` answers 412 and gcsfs raises ``FileExistsError``, as for a create-only simple upload."""
    bucket, key, _ = fs.split_path(path)
    token = uuid.uuid4().hex
    view = memoryview(data)
    spans = compose_ranges(len(data), policy)
    temps = [f"{temp_prefix.rstrip('/')}/{token}-{i:02d}{PART_SUFFIX}" for i in range(len(spans))]
    gate = asyncio.Semaphore(policy.concurrency)

    async def one(temp: str, lo: int, hi: int) -> None:
        async with gate:
            await _retrying(lambda: fs._pipe_file(temp, bytes(view[lo:hi])), retry, deadline)

    try:
        await _gather_all([one(t, lo, hi) for t, (lo, hi) in zip(temps, spans)])
        precondition = {"ifGenerationMatch": 0} if create_only else {}
        body = {"kind": "storage#composeRequest", "destination": {"name": key, "bucket": bucket},
                "sourceObjects": [{"name": fs.split_path(t)[1]} for t in temps]}
        await _retrying(lambda: fs._call("POST", "b/{}/o/{}/compose", bucket, key, json=body, **precondition),
                        retry, deadline)
    finally:  # best effort: no parts left behind (a lifecycle rule on the prefix catches the rest)
        try:
            await asyncio.wait_for(asyncio.gather(*(fs._rm_file(t) for t in temps), return_exceptions=True),
                                   timeout=10)
        except Exception:  # noqa: S110 - the upload's own outcome is what matters
            pass
    fs.invalidate_cache(path)
