"""A run's store deadline at the run layer: :func:`store_policy` turns ``store_timeout_s`` into the
RetryPolicy of every operation made for the run, the functions that open a URL take ``timeout_s``
for the read of run.json (what a replica uses before it knows the config), and a deadline that passes
on an s3:// endpoint that never answers raises StoreUnavailable naming the URL."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import STORE_TIMEOUT_S, RunConfig
from diloco_serverless.run.layout import RUN_JSON
from diloco_serverless.run.record import (
    create_run,
    list_runs,
    load_run,
    open_run_store,
    record_launch,
    store_policy,
    timeout_policy,
)
from diloco_serverless.store.errors import StoreUnavailable
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.store.retry import RetryPolicy

DEADLINE_S = 2.0
BOUND_S = 20.0  # the deadline plus start-up and a backoff sleep on a loaded machine; 60 s or 300 s fail it


def _cfg(store: Path | str, *sets: str) -> RunConfig:
    return RunConfig.load(None, [f'store="{store}"', 'run_id="r1"', *sets])


def test_store_policy_is_the_default_policy_with_the_runs_deadline() -> None:
    policy = store_policy(_cfg("./runs", "store_timeout_s=12.5"))
    assert policy == RetryPolicy(timeout_s=12.5)
    assert store_policy(RunConfig()).timeout_s == STORE_TIMEOUT_S == 60.0


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "5"])
def test_timeout_policy_refuses_what_is_not_a_deadline(bad: Any) -> None:
    with pytest.raises(ValueError, match="store deadline"):
        timeout_policy(bad)
    assert timeout_policy(None) is None
    assert timeout_policy(3) == RetryPolicy(timeout_s=3.0)


def test_open_run_store_takes_a_deadline_and_keeps_the_default_without(tmp_path: Path) -> None:
    assert open_run_store(str(tmp_path / "r1"), timeout_s=5).retry.timeout_s == 5
    assert open_run_store(str(tmp_path / "r1")).retry == RetryPolicy()  # unchanged without one


def test_create_run_from_a_url_uses_the_configs_deadline(tmp_path: Path) -> None:
    run_store, _ = create_run(None, _cfg(tmp_path / "runs", "store_timeout_s=9"))
    assert run_store.retry.timeout_s == 9
    given = ObjectStore(str(tmp_path / "other"), retry=RetryPolicy(timeout_s=4))
    run_store, _ = create_run(given, _cfg(tmp_path / "other", "store_timeout_s=9"))
    assert run_store.retry.timeout_s == 4  # a store passed in keeps its own policy


def test_load_run_and_record_launch_bound_the_first_read(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "runs", "store_timeout_s=9")
    run_store, _ = create_run(None, cfg)
    store, record = load_run(run_store.url, timeout_s=3)
    assert store.retry.timeout_s == 3 and record.config.store_timeout_s == 9
    store, _ = load_run(run_store, timeout_s=2)
    assert store.retry.timeout_s == 2 and run_store.retry.timeout_s == 9  # with_retry: a copy
    assert load_run(run_store)[0].retry.timeout_s == 9
    assert load_run(run_store.url)[0].retry == RetryPolicy()  # unchanged without timeout_s
    # the replica's pattern: read run.json within the default, then go on with the run's deadline
    store, record = load_run(run_store.url, timeout_s=STORE_TIMEOUT_S)
    assert store.with_retry(store_policy(record.config)).retry.timeout_s == 9
    assert record_launch(run_store.url, "local", [], timeout_s=3).launch is not None
    with pytest.raises(ValueError, match="store deadline"):
        load_run(run_store.url, timeout_s=0)


@pytest.fixture
def unanswering_port() -> Iterator[int]:
    """A port that completes TCP connections (the listen backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield int(sock.getsockname()[1])
    sock.close()


def _s3_options(port: int) -> dict[str, Any]:
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}


@pytest.mark.timeout(120)
def test_load_run_fails_within_timeout_s_on_an_unanswering_s3_endpoint(unanswering_port: int) -> None:
    pytest.importorskip("s3fs")
    url = "s3://bucket/runs/r1"
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        load_run(url, _s3_options(unanswering_port), timeout_s=DEADLINE_S)
    elapsed = time.monotonic() - start
    assert f"{url}/{RUN_JSON}" in str(info.value) and f"127.0.0.1:{unanswering_port}" in str(info.value)
    assert elapsed < BOUND_S, f"load_run took {elapsed:.1f} s with timeout_s={DEADLINE_S}"


@pytest.mark.timeout(120)
def test_list_runs_fails_within_timeout_s_on_an_unanswering_s3_endpoint(unanswering_port: int) -> None:
    pytest.importorskip("s3fs")
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="s3://bucket/runs"):
        list_runs("s3://bucket/runs", _s3_options(unanswering_port), timeout_s=DEADLINE_S)
    assert time.monotonic() - start < BOUND_S
