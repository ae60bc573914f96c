"""Storage credentials and settings a remote executor takes from the launcher's environment.

* :func:`gcs_key_secret`: a GCS service-account key *file* (``GOOGLE_APPLICATION_CREDENTIALS``)
  cannot travel to a Job or a container, so its JSON text travels instead, as the secret
  ``GOOGLE_APPLICATION_CREDENTIALS_JSON`` (never as plain environment, never in run.json or a log);
  replicas open ``gs://`` stores with it (``diloco_serverless.store.credentials``).
* :func:`storage_config_env`: the non-secret storage settings (:data:`~.base.STORAGE_CONFIG_ENV`:
  endpoints, regions, the GCS emulator) that replicas need to reach the same store (R2, MinIO).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from diloco_serverless.executors.base import STORAGE_CONFIG_ENV, ExecutorUnavailable

logger = logging.getLogger(__name__)

#: Where Google's libraries look for a key file on this machine.
GCS_KEY_FILE_ENV = "GOOGLE_APPLICATION_CREDENTIALS"
#: The secret carrying that key file's JSON text to the replicas.
GCS_KEY_JSON_ENV = "GOOGLE_APPLICATION_CREDENTIALS_JSON"


def gcs_key_secret(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{GOOGLE_APPLICATION_CREDENTIALS_JSON: <key JSON>}`` from the key file ``$GOOGLE_APPLICATION_CREDENTIALS``
    names, or ``{}`` when it is unset, when ``$GOOGLE_APPLICATION_CREDENTIALS_JSON`` is already set (that one
    wins), or when the file is not a service-account key (user or external-account credentials hold
    refresh tokens for a person, not a key for a machine: a warning says so and nothing is sent).

    Raises ExecutorUnavailable naming the variable and the path (never the content) when the file
    cannot be read or is not JSON.
    """
    env = os.environ if environ is None else environ
    path = env.get(GCS_KEY_FILE_ENV, "").strip()
    if not path or env.get(GCS_KEY_JSON_ENV, "").strip():
        return {}
    try:
        text = Path(path).expanduser().read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ExecutorUnavailable(
            f"${GCS_KEY_FILE_ENV} names {path}, which cannot be read ({type(exc).__name__}); point it at a "
            f"service-account key file or unset it"
        ) from None
    try:
        key = json.loads(text)
    except json.JSONDecodeError:
        raise ExecutorUnavailable(
            f"${GCS_KEY_FILE_ENV} names {path}, which is not JSON; point it at a service-account key file "
            "(IAM > Service accounts > Keys > Add key > JSON) or unset it"
        ) from None
    if not isinstance(key, dict) or key.get("type") != "service_account":
        kind = key.get("type") if isinstance(key, dict) else type(key).__name__
        logger.warning("$%s names %s, a %r credential file and not a service-account key; it is not sent to "
                       "the replicas (create a key for a service account to use GCS from them)",
                       GCS_KEY_FILE_ENV, path, kind)
        return {}
    return {GCS_KEY_JSON_ENV: json.dumps(key, separators=(",", ":"))}


def storage_config_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The :data:`~.base.STORAGE_CONFIG_ENV` variables set here (endpoints, regions, the GCS emulator):
    plain settings, no credentials, that replicas need to reach the store this machine reaches."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in STORAGE_CONFIG_ENV if env.get(name)}
