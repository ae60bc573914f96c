"""The run's store deadline (``store_timeout_s``) in the Python API: ``launch`` and ``Run.attach`` bound
every store operation made for the run by it, and an s3:// endpoint that accepts connections and never
answers fails them within about that time, naming the URL. The endpoint is a real socket server on
127.0.0.1 (:class:`SilentEndpoint`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import STORE_TIMEOUT_S, RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher.api import Run, launch
from diloco_serverless.launcher.preflight import check_launch
from diloco_serverless.store.errors import StoreUnavailable
from support.fake_executor import FakeExecutor
from support.silent_endpoint import SilentEndpoint

#: Long enough for a loaded 2-core machine to build the S3 client and connect before it passes (at 2 s the
#: deadline sometimes ran out first, and the endpoint never saw the connection the tests check for).
DEADLINE_S = 5.0
#: The deadline plus client start-up and a backoff sleep, with room for a loaded machine; the old
#: fixed 300 s deadline (or the 60 s default) would fail it.
BOUND_S = 20.0


@pytest.fixture
def silent() -> Iterator[SilentEndpoint]:
    pytest.importorskip("s3fs")
    endpoint = SilentEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


def _options(endpoint: SilentEndpoint) -> dict[str, Any]:
    return {"endpoint_url": endpoint.url, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}


def _cfg(tmp_path: Path, *sets: str) -> RunConfig:
    return RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="r1"', "rounds=3", *sets])


# ------------------------------------------------------------------------------ plumbing
def test_launch_and_attach_use_the_runs_store_deadline(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path, "store_timeout_s=7"), FakeExecutor())
    assert run.config.store_timeout_s == 7
    assert run._store.retry.timeout_s == 7  # status reads of the launching process
    attached = Run.attach(run.url)
    assert attached._store.retry.timeout_s == 7  # adopted from run.json
    assert Run.attach(run.url, store_timeout_s=3)._store.retry.timeout_s == 3  # the caller's wins
    with pytest.raises(ValueError, match="store deadline"):
        Run.attach(run.url, store_timeout_s=0)


def test_launch_keyword_overrides_the_config(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path, "store_timeout_s=7"), FakeExecutor(), store_timeout_s=4.5)
    assert run.config.store_timeout_s == 4.5
    assert run._store.retry.timeout_s == 4.5
    stored = json.loads((tmp_path / "runs" / "r1" / "run.json").read_text())
    assert stored["config"]["store_timeout_s"] == 4.5  # replicas read the same deadline
    with pytest.raises(LaunchError, match="store_timeout_s"):
        launch(_cfg(tmp_path, 'run_id="r2"'), FakeExecutor(), store_timeout_s=0)
    assert not (tmp_path / "runs" / "r2").exists()


def test_default_deadline_when_the_config_sets_none(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    assert cfg.store_timeout_s == STORE_TIMEOUT_S
    assert check_launch(cfg, FakeExecutor()).root.retry.timeout_s == STORE_TIMEOUT_S
    assert launch(cfg, FakeExecutor())._store.retry.timeout_s == STORE_TIMEOUT_S


# ------------------------------------------------------------------------------ behaviour
@pytest.mark.slow  # waits out a real deadline (seconds): kept out of the fast tier
@pytest.mark.timeout(120)
def test_launch_fails_within_the_deadline_on_an_unresponsive_store(silent: SilentEndpoint) -> None:
    fake = FakeExecutor()
    cfg = RunConfig.load(None, ['store="s3://diloco-silent/runs"', 'run_id="r1"', "replicas=1",
                                f"store_timeout_s={DEADLINE_S}"])
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(cfg, fake, storage_options=_options(silent))
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "s3://diloco-silent/runs" in message and silent.url in message, message
    assert f"{DEADLINE_S:g} s deadline" in message, message
    assert elapsed < BOUND_S, f"launch took {elapsed:.1f} s with store_timeout_s={DEADLINE_S}"
    assert silent.wait_accepted() >= 1  # its connection may still sit in the listen backlog
    assert fake.launched == []


@pytest.mark.slow  # waits out a real deadline (seconds): kept out of the fast tier
@pytest.mark.timeout(120)
def test_attach_fails_within_the_deadline_on_an_unresponsive_store(silent: SilentEndpoint) -> None:
    url = "s3://diloco-silent/runs/r1"
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        Run.attach(url, storage_options=_options(silent), store_timeout_s=DEADLINE_S)
    elapsed = time.monotonic() - start
    assert f"{url}/run.json" in str(info.value) and silent.url in str(info.value)
    assert (info.value.url, info.value.key, info.value.op) == (url, "run.json", "get")
    assert elapsed < BOUND_S, f"Run.attach took {elapsed:.1f} s with store_timeout_s={DEADLINE_S}"
    assert silent.wait_accepted() >= 1  # its connection may still sit in the listen backlog
