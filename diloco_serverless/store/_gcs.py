"""Large objects on GCS as parallel ranged GETs, with no metadata request.

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
"""

from __future__ import annotations

from typing import Any

from diloco_serverless.store._transfer import RangeAnswer, RangeRead, TransferPolicy, VersionChanged, range_total
from diloco_serverless.store.hedge import Hedger

__all__ = ["gcs_reader"]


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
        try:
            data = bytes(await resp.read())
        finally:
            resp.release()
        return RangeAnswer(data, range_total(resp.headers.get("Content-Range"), len(data), lo),
                           resp.headers.get("x-goog-generation"))

    return read
