"""Will remote replicas reach the store? Checked by preflight before the run exists or anything is billed.

The launcher's own probe of the store proves only that *this machine* can use it. Replicas on HF
Jobs or Modal get credentials only from what the executor sends them:

* HF Jobs: the secrets the executor forwards (``AWS_*`` variables set here, a GCS key file's JSON as
  ``GOOGLE_APPLICATION_CREDENTIALS_JSON``, ``DILOCO_STORAGE_OPTIONS``, names given with ``--secret``).
  An AWS profile, SSO login or instance role, or gcloud's application-default login, stays here: an
  ``s3://``/``gs://`` store without forwardable credentials is refused.
* Modal: only named Modal Secrets. Each is looked up (one request each); an ``s3://``/``gs://`` store
  with no secret named is refused (unless the launch uses a deployed App, whose function may carry its
  own secrets, or a GCS emulator).

Warnings (logged, and returned for the caller to show): a forwarded ``AWS_SESSION_TOKEN`` expires
(``AWS_CREDENTIAL_EXPIRATION`` says when; already expired is an error), and forwarded AWS keys that
belong to the account root or an admin identity (one STS ``GetCallerIdentity`` request, best effort).
Values are never logged, returned or stored; messages name variables only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from diloco_serverless.errors import LaunchError
from diloco_serverless.executors.base import ExecutorUnavailable
from diloco_serverless.executors.credentials import GCS_KEY_FILE_ENV, GCS_KEY_JSON_ENV
from diloco_serverless.executors.hf_jobs import HFJobsExecutor
from diloco_serverless.executors.modal import ModalExecutor, import_modal, lookup_secrets

logger = logging.getLogger(__name__)

AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SESSION_TOKEN_ENV = "AWS_SESSION_TOKEN"
#: Set by ``aws configure export-credentials --format env`` next to temporary credentials (ISO 8601).
EXPIRATION_ENV = "AWS_CREDENTIAL_EXPIRATION"
STORAGE_OPTIONS_ENV = "DILOCO_STORAGE_OPTIONS"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_EXPORT_AWS = 'eval "$(aws configure export-credentials --format env)"'


def check_replica_credentials(store_url: str, protocol: str, executor: Any, *, endpoint: str | None = None,
                              environ: Mapping[str, str] | None = None,
                              now: datetime | None = None) -> list[str]:
    """LaunchError when ``executor``'s replicas would get no credentials for the store; else the
    warnings to show (see the module docstring). ``protocol`` is the store's (``s3``, ``gs``, ...),
    ``endpoint`` its custom endpoint if any (where the STS identity check goes)."""
    env = os.environ if environ is None else environ
    if isinstance(executor, HFJobsExecutor):
        return _check_hf_jobs(store_url, protocol, set(executor.secret_names), env, endpoint, now)
    if isinstance(executor, ModalExecutor):
        _check_modal(store_url, protocol, executor, env)
    return []


def _check_hf_jobs(store_url: str, protocol: str, secrets: set[str], env: Mapping[str, str],
                   endpoint: str | None, now: datetime | None) -> list[str]:
    if STORAGE_OPTIONS_ENV in secrets:
        return []  # the user's own fsspec options (keys, tokens, endpoints) travel as they are
    if protocol == "s3":
        missing = [name for name in AWS_KEYS if name not in secrets]
        if missing:
            raise LaunchError(
                f"hf-jobs replicas could not open {store_url}: HF Jobs pass only environment variables to the "
                f"Jobs, and {' and '.join(missing)} are neither set here nor named with --secret (an AWS profile, "
                f"SSO login or instance role stays on this machine). Export them first: {_EXPORT_AWS}, or name "
                "variables that hold them (--secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY)"
            )
        warnings = _session_token_warnings(secrets, env, now)
        identity = _admin_identity_warning(env, endpoint)
        return warnings + ([identity] if identity else [])
    if protocol == "gs" and GCS_KEY_JSON_ENV not in secrets and not env.get(EMULATOR_ENV):
        raise LaunchError(
            f"hf-jobs replicas could not open {store_url}: they get GCS credentials only from a service-account "
            f"key, and none is forwarded (gcloud's login stays on this machine). Set {GCS_KEY_FILE_ENV} to a key "
            f"file (its JSON travels as the secret {GCS_KEY_JSON_ENV}), or set {GCS_KEY_JSON_ENV} to the key's JSON"
        )
    return []


def _check_modal(store_url: str, protocol: str, executor: ModalExecutor, env: Mapping[str, str]) -> None:
    if executor.secrets:
        try:
            lookup_secrets(import_modal(), executor.secrets, executor.environment_name)
        except ExecutorUnavailable as e:
            raise LaunchError(str(e)) from None
        return
    if protocol not in ("s3", "gs") or executor.deployed_app or (protocol == "gs" and env.get(EMULATOR_ENV)):
        return
    example = ("AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=..." if protocol == "s3"
               else f"{GCS_KEY_JSON_ENV}=\"$(cat key.json)\"")
    raise LaunchError(
        f"modal replicas could not open {store_url}: Modal containers get storage credentials only from Modal "
        f"Secrets, and none is named. Create one (modal secret create diloco-store {example}) and pass "
        "--secret diloco-store (Python: executor_options={'secrets': ['diloco-store']})"
    )


def _session_token_warnings(secrets: set[str], env: Mapping[str, str], now: datetime | None) -> list[str]:
    """A warning when a session token is forwarded (it expires mid-run); LaunchError when it already has."""
    if SESSION_TOKEN_ENV not in secrets:
        return []
    when = ""
    expires = _parse_time(env.get(EXPIRATION_ENV, ""))
    if expires is not None:
        minutes = (expires - (now or datetime.now(UTC))).total_seconds() / 60
        if minutes <= 0:
            raise LaunchError(
                f"the temporary AWS credentials expired {-minutes:.0f} minutes ago ({EXPIRATION_ENV}); "
                f"refresh them ({_EXPORT_AWS}) before launching"
            )
        when = f" in {minutes:.0f} minutes ({EXPIRATION_ENV})"
    message = (f"forwarding {SESSION_TOKEN_ENV} to the replicas: these temporary AWS credentials expire{when}, and "
               "every replica then fails on the store; for a long run use an access key limited to the bucket "
               "(see infra/)")
    logger.warning("%s", message)
    return [message]


def _parse_time(text: str) -> datetime | None:
    text = text.strip()
    if not text:
        return None
    try:
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=UTC)


def _admin_identity_warning(env: Mapping[str, str], endpoint: str | None) -> str | None:
    """A warning when the forwarded AWS keys are the account root's or an admin's (STS
    ``GetCallerIdentity``: one request, 5 s at most; any failure skips the check)."""
    if not all(env.get(name) for name in AWS_KEYS):
        return None
    try:
        import boto3
        from botocore.config import Config

        sts = boto3.client(
            "sts", endpoint_url=endpoint, region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
            or "us-east-1", aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], aws_session_token=env.get(SESSION_TOKEN_ENV) or None,
            config=Config(connect_timeout=5, read_timeout=5, retries={"total_max_attempts": 1}))
        arn = str(sts.get_caller_identity()["Arn"])
    except Exception as exc:  # best effort: R2/MinIO have no STS, boto3 may be missing
        logger.debug("skipped the AWS identity check: %s", type(exc).__name__)
        return None
    if not (arn.endswith(":root") or "admin" in arn.lower()):
        return None
    message = (f"the AWS credentials forwarded to the replicas belong to {arn}, an account root or admin identity: "
               "every replica (and any code it runs) holds them; use an access key limited to the bucket (see infra/)")
    logger.warning("%s", message)
    return message
