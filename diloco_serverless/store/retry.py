"""Retry with capped exponential backoff and a per-operation deadline, for the object store.

Only errors for which :func:`diloco_serverless.store.errors.is_transient` is true are retried
(the model is s3fs's ``_error_wrapper``: a declared tuple of retryable errors, capped backoff).
Anything else is translated at once. When the attempts or the deadline run out, the last
transient error becomes :class:`~diloco_serverless.store.errors.StoreUnavailable`.
A store's ``503 SlowDown`` (too many requests on one prefix) is transient: it is retried with the
same jittered exponential backoff, so concurrent replicas that were throttled together spread out.
The parts of a large transfer (:mod:`diloco_serverless.store._transfer`) are retried one by one with
this policy's :meth:`RetryPolicy.delay_s` inside the operation's deadline.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from diloco_serverless.store.errors import (
    StoreUnavailable,
    is_transient,
    translate_error,
)

__all__ = ["RetryPolicy", "call_with_retry"]

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard an :class:`~diloco_serverless.store.ObjectStore` operation tries.

    Attributes:
        max_attempts: attempts per operation, the first included (>= 1).
        base_delay_s: backoff before the second attempt; doubles each retry.
        max_delay_s: cap on one backoff sleep.
        timeout_s: deadline for the whole operation, attempts, transfers and sleeps
            included. Each attempt on an async back end (s3fs, gcsfs) is cancelled when it
            passes the deadline, so a store that never answers fails with
            ``StoreUnavailable`` in about this time; one that refuses connections fails
            sooner, after ``max_attempts``. It must leave room for the largest legitimate
            transfer. The default (300 s) is for code that opens a store without a run; a run's
            store operations use the run's ``store_timeout_s`` (``run.record.store_policy``),
            the CLI its ``--store-timeout``, and the exchange its own round timeout
            (``ObjectStore(url, retry=RetryPolicy(timeout_s=...))`` or ``store.with_retry``).
        jitter: fraction of each sleep randomised (0 = deterministic).
    """

    max_attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    timeout_s: float = 300.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.timeout_s <= 0:
            raise ValueError(f"RetryPolicy.timeout_s must be > 0, got {self.timeout_s}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")

    def delay_s(self, retry: int) -> float:
        """Backoff before retry number ``retry`` (1-based), capped, with jitter."""
        delay = min(self.max_delay_s, self.base_delay_s * (2 ** (retry - 1)))
        return float(delay * (1 - self.jitter * random.random()))


def call_with_retry(
    attempt: Callable[[float], T], *, policy: RetryPolicy, url: str, key: str, op: str,
    on_retry: Callable[[BaseException], None] | None = None, endpoint: str | None = None,
) -> T:
    """Run ``attempt(remaining_s)`` until it succeeds, a non-transient error occurs, or the
    attempts/deadline run out.

    ``attempt`` receives the seconds left before the deadline and should bound its own wait
    by it. Raises a :class:`~diloco_serverless.errors.StoreError` subclass naming
    ``op``, ``url`` and ``key`` (and ``endpoint``, the server actually contacted, when given and
    the store is unavailable); never returns a partial result.
    """
    deadline = time.monotonic() + policy.timeout_s
    last: BaseException | None = None
    made = 0
    for n in range(1, policy.max_attempts + 1):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        made = n
        try:
            return attempt(remaining)
        except Exception as exc:
            if not is_transient(exc):
                raise translate_error(exc, url=url, key=key, op=op) from exc
            last = exc
            if on_retry is not None:
                on_retry(exc)
        if n < policy.max_attempts:
            time.sleep(max(0.0, min(policy.delay_s(n), deadline - time.monotonic())))
    where = f"{url}/{key}" if key else url
    if endpoint:
        where += f" (endpoint {endpoint})"
    detail = "deadline passed" if last is None else f"{type(last).__name__}: {last}"
    if last is not None and not str(last):
        detail = f"{type(last).__name__}: no answer before the deadline"
    raise StoreUnavailable(
        f"{op} {where}: store unreachable or failing after {made} attempt(s) within the "
        f"{policy.timeout_s:g} s deadline; check the endpoint, network and credentials, or raise the "
        f"deadline (--store-timeout, the run config's store_timeout_s, RetryPolicy.timeout_s) [{detail}]",
        url=url, key=key, op=op,
    ) from last
