"""An unavailable store's error names the server it tried to reach (a custom endpoint), without
credentials, next to the store URL and key, and says how to raise the deadline."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from diloco_serverless.store.errors import StoreUnavailable
from diloco_serverless.store.objectstore import ENV_STORAGE_OPTIONS, ObjectStore
from diloco_serverless.store.retry import RetryPolicy

QUICK = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.2, timeout_s=1.0)


@pytest.fixture
def unanswering_port() -> Iterator[int]:
    """A port that completes TCP connections (the listen backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield int(sock.getsockname()[1])
    sock.close()


@pytest.fixture
def no_endpoint_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST", ENV_STORAGE_OPTIONS):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(60)
def test_unavailable_names_the_endpoint_and_the_deadline(unanswering_port: int, no_endpoint_env: None) -> None:
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{unanswering_port}"
    store = ObjectStore("s3://bucket/run", {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
                                            "client_kwargs": {"region_name": "us-east-1"},
                                            "skip_instance_cache": True}, retry=QUICK)
    with pytest.raises(StoreUnavailable) as info:
        store.child("sub").get("run.json")
    message = str(info.value)
    assert f"get s3://bucket/run/sub/run.json (endpoint {endpoint})" in message
    assert "1 s deadline" in message and "--store-timeout" in message and "store_timeout_s" in message


def test_endpoint_comes_from_options_or_environment(monkeypatch: pytest.MonkeyPatch, no_endpoint_env: None) -> None:
    pytest.importorskip("s3fs")
    assert ObjectStore("s3://bucket").endpoint is None  # AWS itself: nothing to name
    assert ObjectStore("memory://x").endpoint is None and ObjectStore("./x").endpoint is None
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    assert ObjectStore("s3://bucket").endpoint == "http://minio:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-only:9000")
    assert ObjectStore("s3://bucket").endpoint == "http://s3-only:9000"
    store = ObjectStore("s3://bucket", {"client_kwargs": {"endpoint_url": "https://user:pass@r2.example"}})
    assert store.endpoint == "https://r2.example"  # credentials in a URL are never shown
