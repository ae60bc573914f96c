"""ObjectStore failure behaviour: retries of transient errors only, denial, unreachable stores.

Run: python -m pytest -q tests/store/test_store_errors.py
"""

from __future__ import annotations

import errno
import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from diloco_serverless.errors import StoreError
from diloco_serverless.store.errors import (
    ObjectNotFound,
    StoreAccessDenied,
    StoreUnavailable,
    is_transient,
    translate_error,
)
from diloco_serverless.store.objectstore import (
    ENV_STORAGE_OPTIONS,
    ObjectStore,
    storage_options_from_env,
)
from diloco_serverless.store.retry import RetryPolicy
from support.moto_s3 import free_port

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.001, max_delay_s=0.01, timeout_s=30.0)


class FlakyFS:
    """Wraps an fsspec file system; ``fail[method]`` is a list of exceptions (or callables
    returning one) raised by the next calls of that method, in order. Counts every call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.fail: dict[str, list[Any]] = {}
        self.calls: dict[str, int] = {}
        self.write_before_failing = False

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target) or name.startswith("__"):
            return target

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            queue = self.fail.get(name)
            if queue:
                exc = queue.pop(0)
                if self.write_before_failing:
                    target(*args, **kwargs)  # the request landed; only the response is lost
                raise exc() if callable(exc) and not isinstance(exc, BaseException) else exc
            return target(*args, **kwargs)

        return wrapper


@pytest.fixture
def flaky(memory_store_url: str) -> Iterator[tuple[ObjectStore, FlakyFS]]:
    store = ObjectStore(memory_store_url, retry=FAST)
    fake = FlakyFS(store.fs)
    store._fs = fake
    yield store, fake


def test_transient_errors_are_retried_then_succeed(flaky: tuple[ObjectStore, FlakyFS]) -> None:
    store, fs = flaky
    fs.fail["pipe_file"] = [ConnectionResetError("reset"), OSError(errno.EBUSY, "SlowDown")]
    store.put("a", b"payload")
    assert fs.calls["pipe_file"] == 3
    fs.fail["cat_file"] = [TimeoutError("read timed out")]
    assert store.get("a") == b"payload"
    assert fs.calls["cat_file"] == 2


def test_list_dirs_retries_transient_errors_and_names_the_prefix(flaky: tuple[ObjectStore, FlakyFS]) -> None:
    store, fs = flaky
    store.put("run-a/run.json", b"{}")
    fs.fail["ls"] = [ConnectionResetError("reset")]
    assert store.list_dirs() == ["run-a"] and fs.calls["ls"] == 2
    fs.fail["ls"] = [PermissionError("AccessDenied")]
    with pytest.raises(StoreAccessDenied, match="run-a"):
        store.list_dirs("run-a")
    assert fs.calls["ls"] == 3  # not retried


def test_non_transient_errors_are_not_retried(flaky: tuple[ObjectStore, FlakyFS]) -> None:
    store, fs = flaky
    fs.fail["pipe_file"] = [PermissionError("AccessDenied")]
    with pytest.raises(StoreAccessDenied) as info:
        store.put("rounds/00000001/quorum.json", b"x")
    assert fs.calls["pipe_file"] == 1
    assert store.url in str(info.value) and "rounds/00000001/quorum.json" in str(info.value)
    fs.fail["cat_file"] = [ValueError("bad request")]
    with pytest.raises(StoreError, match="ValueError") as info2:
        store.get("x")
    assert not isinstance(info2.value, StoreUnavailable)
    assert fs.calls["cat_file"] == 1


def test_retries_exhausted_raise_unavailable(flaky: tuple[ObjectStore, FlakyFS]) -> None:
    store, fs = flaky
    fs.fail["cat_file"] = [ConnectionRefusedError("refused")] * 10
    with pytest.raises(StoreUnavailable) as info:
        store.get("members/rank-3.json")
    assert fs.calls["cat_file"] == FAST.max_attempts
    assert "members/rank-3.json" in str(info.value) and store.url in str(info.value)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert isinstance(info.value, ConnectionError)


def test_get_many_thread_path_retries_per_key(flaky: tuple[ObjectStore, FlakyFS]) -> None:
    store, fs = flaky
    for i in range(4):
        store.put(f"k{i}", bytes([i]))
    fs.fail["cat_file"] = [ConnectionResetError("reset")]
    assert store.get_many([f"k{i}" for i in range(4)]) == {f"k{i}": bytes([i]) for i in range(4)}
    assert fs.calls["cat_file"] == 5


def test_put_if_absent_after_lost_response_reports_creation(
        flaky: tuple[ObjectStore, FlakyFS]) -> None:
    """The first attempt's write lands but its response is lost; the retry finds the object.
    It holds our bytes, so the call reports that it created it."""
    store, fs = flaky
    fs.write_before_failing = True
    fs.fail["pipe_file"] = [ConnectionResetError("reset after write")]
    assert store.put_if_absent("quorum.json", b"mine") is True
    fs.fail["pipe_file"] = [ConnectionResetError("reset after write")]
    assert store.put_if_absent("quorum.json", b"other") is False
    assert store.get("quorum.json") == b"mine"


def test_classification() -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError
    from gcsfs.retry import HttpError

    slow = ClientError({"Error": {"Code": "SlowDown", "Message": "slow"}}, "PutObject")
    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject")
    assert is_transient(slow) and not is_transient(denied)
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(HttpError({"code": 503, "message": "unavailable"}))
    assert not is_transient(HttpError({"code": 400, "message": "bad"}))
    assert is_transient(OSError(errno.EBUSY, "SlowDown"))  # s3fs's translation of 503
    assert not is_transient(FileNotFoundError("x")) and not is_transient(ValueError("x"))
    err = translate_error(HttpError({"code": 403, "message": "Forbidden"}), url="gs://b", key="k", op="get")
    assert isinstance(err, StoreAccessDenied) and "gs://b/k" in str(err)
    assert isinstance(translate_error(FileNotFoundError("x"), url="u", key="k", op="get"), ObjectNotFound)


def test_retry_policy_validation() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RetryPolicy(timeout_s=0)
    policy = RetryPolicy(base_delay_s=1.0, max_delay_s=4.0, jitter=0.0)
    assert [policy.delay_s(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 4.0, 4.0]


def test_storage_options_from_env(monkeypatch: pytest.MonkeyPatch, memory_store_url: str) -> None:
    monkeypatch.delenv(ENV_STORAGE_OPTIONS, raising=False)
    assert storage_options_from_env() == {}
    monkeypatch.setenv(ENV_STORAGE_OPTIONS, json.dumps({"endpoint_url": "http://e", "anon": True}))
    assert storage_options_from_env() == {"endpoint_url": "http://e", "anon": True}
    monkeypatch.setenv(ENV_STORAGE_OPTIONS, "[1, 2]")
    with pytest.raises(ValueError, match=ENV_STORAGE_OPTIONS):
        storage_options_from_env()
    monkeypatch.setenv(ENV_STORAGE_OPTIONS, "{not json")
    with pytest.raises(ValueError, match=ENV_STORAGE_OPTIONS):
        storage_options_from_env()
    ObjectStore(memory_store_url)  # local/memory stores ignore the variable


def test_env_options_merge_under_explicit(monkeypatch: pytest.MonkeyPatch, s3_store_url: str,
                                          s3_storage_options: dict[str, Any]) -> None:
    monkeypatch.setenv(ENV_STORAGE_OPTIONS, json.dumps(
        {"endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"read_timeout": 7}}))
    store = ObjectStore(s3_store_url, s3_storage_options)
    assert store.fs.endpoint_url == s3_storage_options["endpoint_url"]
    store.put("x", b"1")  # explicit endpoint wins over the env's dead one
    assert store._options["config_kwargs"]["read_timeout"] == 7
    assert store._options["config_kwargs"]["retries"] == {"total_max_attempts": 1}  # not mutated


# --------------------------------------------------------------------------- unreachable
def _closed_port() -> int:
    return free_port()  # free a moment ago: nothing listens there


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts TCP connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield int(sock.getsockname()[1])
    sock.close()


QUICK = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.2, timeout_s=2.0)


def _s3_options(port: int) -> dict[str, Any]:
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [lambda s: s.get("k"), lambda s: s.put_if_absent("k", b"x"),
                                lambda s: s.list(), lambda s: s.list_dirs(), lambda s: s.get_many(["k", "j"])],
                         ids=["get", "put_if_absent", "list", "list_dirs", "get_many"])
def test_s3_closed_port_is_unavailable(op: Callable[[ObjectStore], Any]) -> None:
    store = ObjectStore("s3://bucket/run", _s3_options(_closed_port()), retry=QUICK)
    with pytest.raises(StoreUnavailable, match="s3://bucket/run"):
        op(store)


@pytest.mark.timeout(60)
def test_s3_silent_server_hits_the_deadline(silent_server: int) -> None:
    """A server that never answers: each attempt is cancelled at the policy's deadline."""
    store = ObjectStore("s3://bucket/run", _s3_options(silent_server), retry=QUICK)
    with pytest.raises(StoreUnavailable, match="run.json"):
        store.get("run.json")


@pytest.mark.timeout(60)
def test_gcs_closed_port_is_unavailable() -> None:
    store = ObjectStore("gs://bucket/run", {"endpoint_url": f"http://127.0.0.1:{_closed_port()}",
                                            "token": "anon", "skip_instance_cache": True},
                        retry=QUICK)
    with pytest.raises(StoreUnavailable, match="gs://bucket/run/k"):
        store.get("k")


# --------------------------------------------------------------------------- denied (moto IAM)
@pytest.fixture
def moto_read_only_keys(s3_server: str, s3_store_url: str,
                        monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An IAM user allowed only to read ``s3_store_url``; moto's auth switched on for the test."""
    import boto3
    from moto import settings

    iam = boto3.client("iam", endpoint_url=s3_server, aws_access_key_id="testing",
                       aws_secret_access_key="testing", region_name="us-east-1")
    user = "reader-" + s3_store_url.split("/")[-1]
    iam.create_user(UserName=user)
    bucket = s3_store_url[len("s3://"):]
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
         "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}
    iam.put_user_policy(UserName=user, PolicyName="read", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


def test_s3_denied_is_access_denied(s3_server: str, s3_store_url: str,
                                    moto_read_only_keys: dict[str, str]) -> None:
    options = {"endpoint_url": s3_server, "client_kwargs": {"region_name": "us-east-1"},
               "skip_instance_cache": True, **moto_read_only_keys}
    store = ObjectStore(s3_store_url + "/run", options, retry=FAST)
    with pytest.raises(StoreAccessDenied) as info:
        store.put("rounds/00000000/quorum.json", b"x")
    assert "rounds/00000000/quorum.json" in str(info.value) and s3_store_url in str(info.value)
    with pytest.raises(StoreAccessDenied):
        store.put_if_absent("rounds/00000000/quorum.json", b"x")
    assert store.list() == []  # reading is allowed
    bad = dict(options, key="AKIAUNKNOWN000000000", secret="nope")
    with pytest.raises(StoreAccessDenied):
        ObjectStore(s3_store_url, bad, retry=FAST).get("run.json")
