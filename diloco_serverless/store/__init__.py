"""Bytes in a bucket: the :class:`ObjectStore` over fsspec (S3, GCS, a local folder, memory).

The bottom layer: it imports nothing else from the package except :mod:`diloco_serverless.errors`.
``put_if_absent`` is the one consistency primitive everything above builds on (S3
``If-None-Match: *``, GCS ``ifGenerationMatch=0``, a hard link on local disks); errors name the URL
and key, and only transient failures are retried (:mod:`.retry`); large S3 objects travel as parallel
parts (:mod:`._transfer`). See docs/architecture.md.
"""

from __future__ import annotations

from diloco_serverless.store.errors import (
    ObjectNotFound,
    ObjectTooLarge,
    StoreAccessDenied,
    StoreError,
    StoreUnavailable,
    is_transient,
    translate_error,
)
from diloco_serverless.store.objectstore import (
    ENV_STORAGE_OPTIONS,
    ObjectStore,
    TransferPolicy,
    storage_options_from_env,
)
from diloco_serverless.store.retry import RetryPolicy, call_with_retry

__all__ = [
    "ENV_STORAGE_OPTIONS",
    "ObjectNotFound",
    "ObjectStore",
    "ObjectTooLarge",
    "RetryPolicy",
    "StoreAccessDenied",
    "StoreError",
    "StoreUnavailable",
    "TransferPolicy",
    "call_with_retry",
    "is_transient",
    "storage_options_from_env",
    "translate_error",
]
