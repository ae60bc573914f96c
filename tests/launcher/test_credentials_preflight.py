"""Preflight proves remote replicas will reach the store before the run exists (launcher/credentials.py),
and replicas use a GCS key that travels as JSON (store/credentials.py, executors/credentials.py).

Real pieces: the real HFJobsExecutor and ModalExecutor classes (the Modal SDK replaced at the module
level by a fake that records Secret look-ups and spawns, as in tests/executors/test_executor_modal.py),
moto's S3 and STS on 127.0.0.1, the GCS emulator with a local OAuth token endpoint, and a real RSA key.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.executors.base import ExecutorUnavailable
from diloco_serverless.executors.credentials import gcs_key_secret
from diloco_serverless.executors.modal import ModalExecutor
from diloco_serverless.launcher.credentials import check_replica_credentials
from diloco_serverless.launcher.preflight import check_launch
from diloco_serverless.store.credentials import gcs_key_from_env
from diloco_serverless.store.objectstore import ObjectStore

modal_exception = pytest.importorskip("modal.exception")
pytest.importorskip("huggingface_hub")

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_CREDENTIAL_EXPIRATION",
            "AWS_PROFILE", "DILOCO_STORAGE_OPTIONS", "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_APPLICATION_CREDENTIALS_JSON", "STORAGE_EMULATOR_HOST", "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _cfg(store: str) -> RunConfig:
    return RunConfig.load(None, ["replicas=2", f'store="{store}"', f'run_id="r-{uuid.uuid4().hex[:8]}"'])


HF_OPTIONS = {"token": "hf_fake", "namespace": "me", "install": None}


# --------------------------------------------------------------------------- HF Jobs, S3
def test_hf_jobs_s3_without_exported_keys_is_refused_before_the_run_exists(
    s3_store_url: str, s3_storage_options: dict[str, Any]
) -> None:
    """An AWS profile/SSO user passes the local probe (storage options here) but the Jobs get nothing."""
    cfg = _cfg(s3_store_url)
    with pytest.raises(LaunchError) as err:
        check_launch(cfg, "hf-jobs", executor_options=dict(HF_OPTIONS), storage_options=s3_storage_options)
    text = str(err.value)
    assert "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in text
    assert 'eval "$(aws configure export-credentials --format env)"' in text and "--secret" in text
    assert ObjectStore(s3_store_url, s3_storage_options).list("") == []  # nothing created, probe removed


def test_hf_jobs_s3_with_keys_passes_and_a_session_token_is_warned_about(
    s3_store_url: str, s3_storage_options: dict[str, Any], s3_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in s3_env.items():
        monkeypatch.setenv(name, value)
    plan = check_launch(_cfg(s3_store_url), "hf-jobs", executor_options=dict(HF_OPTIONS),
                        storage_options=s3_storage_options)
    assert plan.warnings == []  # long-lived keys of a plain user ("moto"): nothing to say

    monkeypatch.setenv("AWS_SESSION_TOKEN", "FwoGZXIvYXdzEXAMPLETOKEN")
    expires = datetime.now(UTC) + timedelta(minutes=45, seconds=30)
    monkeypatch.setenv("AWS_CREDENTIAL_EXPIRATION", expires.isoformat().replace("+00:00", "Z"))
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.launcher.credentials"):
        plan = check_launch(_cfg(s3_store_url), "hf-jobs", executor_options=dict(HF_OPTIONS),
                            storage_options=s3_storage_options)
    assert len(plan.warnings) == 1
    warning = plan.warnings[0]
    assert "AWS_SESSION_TOKEN" in warning and ("in 45 minutes" in warning or "in 46 minutes" in warning)
    assert warning in caplog.text and "EXAMPLETOKEN" not in caplog.text + warning

    monkeypatch.setenv("AWS_CREDENTIAL_EXPIRATION", (datetime.now(UTC) - timedelta(minutes=5)).isoformat())
    with pytest.raises(LaunchError, match="expired 5 minutes ago"):
        check_launch(_cfg(s3_store_url), "hf-jobs", executor_options=dict(HF_OPTIONS),
                     storage_options=s3_storage_options)


def test_hf_jobs_warns_when_the_forwarded_keys_are_an_admin_identity(
    s3_server: str, s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One STS GetCallerIdentity (moto resolves the key to its IAM user) tells an admin key apart."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    user = f"ops-admin-{uuid.uuid4().hex[:6]}"
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    env = {**s3_env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    executor = _hf_executor()
    warnings = check_replica_credentials("s3://b/runs", "s3", executor, endpoint=s3_server)
    assert len(warnings) == 1 and f"user/{user}" in warnings[0] and "admin" in warnings[0]
    assert key["SecretAccessKey"] not in warnings[0]
    # no STS (an R2/MinIO endpoint that does not answer it): the check is skipped, the launch goes on
    assert check_replica_credentials("s3://b/runs", "s3", executor, endpoint="http://127.0.0.1:9") == []


def test_hf_jobs_named_storage_options_secret_counts_as_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_STORAGE_OPTIONS", '{"key": "k", "secret": "s"}')
    assert check_replica_credentials("s3://b/runs", "s3", _hf_executor()) == []
    monkeypatch.delenv("DILOCO_STORAGE_OPTIONS")
    with pytest.raises(LaunchError, match="AWS_ACCESS_KEY_ID"):  # forward_credentials=False sends none
        check_replica_credentials("s3://b/runs", "s3", _hf_executor(forward_credentials=False))


def _hf_executor(**options: Any) -> Any:
    from diloco_serverless.executors.hf_jobs import HFJobsExecutor

    return HFJobsExecutor(**{**HF_OPTIONS, **options})


# --------------------------------------------------------------------------- GCS key as a secret
def _service_account_key(token_uri: str) -> dict[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    return {"type": "service_account", "project_id": "test-project", "private_key_id": "k1", "private_key": pem,
            "client_email": "replica@test-project.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": token_uri}


def test_hf_jobs_gs_needs_a_service_account_key_and_sends_it_as_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(LaunchError, match="GOOGLE_APPLICATION_CREDENTIALS to a key"):
        check_replica_credentials("gs://b/runs", "gs", _hf_executor())

    key = _service_account_key("https://oauth2.example.invalid/token")
    key_file = tmp_path / "key.json"
    key_file.write_text(json.dumps(key))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key_file))
    executor = _hf_executor()
    assert "GOOGLE_APPLICATION_CREDENTIALS_JSON" in executor.secret_names
    assert check_replica_credentials("gs://b/runs", "gs", executor) == []
    assert json.loads(gcs_key_secret()["GOOGLE_APPLICATION_CREDENTIALS_JSON"]) == key

    # a person's gcloud login (authorized_user) is not sent: a warning, and preflight refuses gs://
    key_file.write_text(json.dumps({"type": "authorized_user", "refresh_token": "1//secret"}))
    with caplog.at_level(logging.WARNING):
        assert gcs_key_secret() == {}
    assert "not a service-account key" in caplog.text and "1//secret" not in caplog.text
    with pytest.raises(LaunchError, match="service-account"):
        check_replica_credentials("gs://b/runs", "gs", _hf_executor())

    key_file.write_text("{not json")
    with pytest.raises(ExecutorUnavailable, match=f"names {key_file}, which is not JSON"):
        gcs_key_secret()
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ExecutorUnavailable, match="cannot be read"):
        gcs_key_secret()


class _TokenEndpoint:
    """A local OAuth2 token endpoint: records the JWT assertions posted to it, answers an access token."""

    def __init__(self) -> None:
        self.assertions: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                jwt = parse_qs(body)["assertion"][0]
                payload = jwt.split(".")[1]
                outer.assertions.append(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
                data = json.dumps({"access_token": "ya29.local", "expires_in": 3600, "token_type": "Bearer"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def token_endpoint() -> Iterator[_TokenEndpoint]:
    endpoint = _TokenEndpoint()
    yield endpoint
    endpoint.server.shutdown()
    endpoint.server.server_close()


def test_replica_opens_gs_with_the_key_json(
    gcs_store_url: str, gcs_env: dict[str, str], token_endpoint: _TokenEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica side: GOOGLE_APPLICATION_CREDENTIALS_JSON is the service account gcsfs signs in as
    (it wins over the emulator's anonymous access); the key is never written to disk."""
    for name, value in gcs_env.items():
        monkeypatch.setenv(name, value)
    key = _service_account_key(token_endpoint.url)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS_JSON", json.dumps(key))
    store = ObjectStore(gcs_store_url)
    store.put("hello", b"world")
    assert store.get("hello") == b"world"
    assert [a["iss"] for a in token_endpoint.assertions][:1] == [key["client_email"]]
    assert store.fs.credentials.credentials.token == "ya29.local"

    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS_JSON", '{"type": "authorized_user"}')
    with pytest.raises(ValueError, match="not a service-account key") as err:
        gcs_key_from_env()
    assert "authorized_user" in str(err.value)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS_JSON", "not json")
    with pytest.raises(ValueError, match=r"GOOGLE_APPLICATION_CREDENTIALS_JSON is not valid JSON"):
        ObjectStore(gcs_store_url)


# --------------------------------------------------------------------------- Modal
@pytest.fixture
def fake_modal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real ``modal`` SDK against the fake Modal server, whose workspace has one Secret, ``diloco-s3``."""
    from support.modal_grpc_server import fake_modal as fake_modal_server

    with fake_modal_server(monkeypatch) as srv:
        srv.secrets = {"diloco-s3"}
        yield srv


def _lookups(srv: Any) -> list[tuple[str, str]]:
    return [(r.deployment_name, r.environment_name) for r in srv.sent("SecretGetOrCreate")]


def test_modal_unknown_secret_is_refused_before_the_run_exists(
    fake_modal: Any, s3_store_url: str, s3_storage_options: dict[str, Any]
) -> None:
    cfg = _cfg(s3_store_url)
    with pytest.raises(LaunchError) as err:
        check_launch(cfg, "modal", executor_options={"secrets": ["diloco-s3", "typo-creds"]},
                     storage_options=s3_storage_options)
    assert "no Modal Secret named 'typo-creds'" in str(err.value) and "modal secret create" in str(err.value)
    assert [name for name, _ in _lookups(fake_modal)] == ["diloco-s3", "typo-creds"]
    assert ObjectStore(s3_store_url, s3_storage_options).list("") == []

    plan = check_launch(cfg, "modal", executor_options={"secrets": ["diloco-s3"], "environment_name": "dev"},
                        storage_options=s3_storage_options)
    assert plan.kind == "modal" and _lookups(fake_modal)[-1] == ("diloco-s3", "dev")


def test_modal_bucket_store_without_any_secret_is_refused(fake_modal: Any) -> None:
    for url, proto, hint in [("s3://b/runs", "s3", "AWS_ACCESS_KEY_ID="), ("gs://b/runs", "gs", "cat key.json")]:
        with pytest.raises(LaunchError, match="none is named") as err:
            check_replica_credentials(url, proto, ModalExecutor())
        assert hint in str(err.value) and "--secret diloco-store" in str(err.value)
    # a deployed App's function may carry its own secrets; a GCS emulator takes none
    assert check_replica_credentials("s3://b/runs", "s3", ModalExecutor(deployed_app="diloco-serverless")) == []
    assert check_replica_credentials("gs://b/runs", "gs", ModalExecutor(), environ={"STORAGE_EMULATOR_HOST": "x"}) == []
    assert _lookups(fake_modal) == []


def test_modal_replicas_get_the_storage_endpoint_settings_but_no_credentials(
    fake_modal: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = {"AWS_ENDPOINT_URL": "https://acct.r2.cloudflarestorage.com", "AWS_ENDPOINT_URL_S3": "https://s3.x",
                "AWS_REGION": "auto", "AWS_DEFAULT_REGION": "auto", "STORAGE_EMULATOR_HOST": "http://10.0.0.2:9023"}
    for name, value in {**settings, "AWS_SECRET_ACCESS_KEY": "never-sent", "AWS_ACCESS_KEY_ID": "AKIA"}.items():
        monkeypatch.setenv(name, value)
    executor = ModalExecutor(deployed_app="diloco-serverless", secrets=["diloco-s3"], show_output=False)
    executor.launch_replicas(2, "diloco_serverless.entrypoints.replica", ["--run-url", "s3://b/runs/r1"],
                             env={"DILOCO_RUN_URL": "s3://b/runs/r1", "AWS_REGION": "eu-west-1"})
    from modal._serialization import deserialize

    spawned = [deserialize(r.pipelined_inputs[0].input.args, None)[0][3] for r in fake_modal.sent("FunctionMap")]
    assert len(spawned) == 2
    for env in spawned:
        assert "never-sent" not in env.values() and "AKIA" not in env.values()
        assert {k: env[k] for k in settings} == {**settings, "AWS_REGION": "eu-west-1"}  # the launch's env wins
        assert "never-sent" not in json.dumps(env) and "AWS_ACCESS_KEY_ID" not in env
