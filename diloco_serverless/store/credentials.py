"""Credentials a replica finds in its environment that fsspec would not pick up by itself.

Remote executors cannot ship a key *file*: on HF Jobs and Modal, a GCS service-account key travels
as the JSON text of the key in the secret ``GOOGLE_APPLICATION_CREDENTIALS_JSON`` (docs/security.md).
:func:`gcs_key_from_env` reads it back so that ``gs://`` stores open with that service account
(gcsfs ``token=<the key as a dict>``); the key is held in memory only, never written to disk.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: The secret holding a GCS service-account key's JSON text (set by the HF Jobs executor from the
#: launcher's ``GOOGLE_APPLICATION_CREDENTIALS`` key file, or put in a Modal Secret by the user).
GCS_KEY_JSON_ENV = "GOOGLE_APPLICATION_CREDENTIALS_JSON"


def gcs_key_from_env() -> dict[str, Any] | None:
    """The service-account key in ``$GOOGLE_APPLICATION_CREDENTIALS_JSON`` as a dict, or None when unset.

    Raises ``ValueError`` naming the variable (never its value) when it is not a JSON object of a
    service-account key.
    """
    raw = os.environ.get(GCS_KEY_JSON_ENV, "").strip()
    if not raw:
        return None
    fix = ("set it to the content of a service-account key file, e.g. "
           f"{GCS_KEY_JSON_ENV}=\"$(cat key.json)\" (or unset it to use the default credentials)")
    try:
        key = json.loads(raw)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ValueError(f"${GCS_KEY_JSON_ENV} is not valid JSON ({where}); {fix}") from None
    if not isinstance(key, dict):
        raise ValueError(f"${GCS_KEY_JSON_ENV} must be a JSON object, got {type(key).__name__}; {fix}")
    missing = [k for k in ("client_email", "private_key", "token_uri") if not key.get(k)]
    if key.get("type") != "service_account" or missing:
        kind = key.get("type")
        what = f"has type {kind!r}" if kind != "service_account" else f"lacks {', '.join(missing)}"
        raise ValueError(f"${GCS_KEY_JSON_ENV} is not a service-account key (it {what}); {fix}")
    return key
