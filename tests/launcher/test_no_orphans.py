"""No orphans: once ``launch`` has started replicas, a failure (here: recording their handles in
run.json) cancels them; when cancelling fails too, the error names every handle to cancel by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher import api
from diloco_serverless.launcher.api import launch
from diloco_serverless.run.record import load_run
from support.fake_executor import FakeExecutor


def _cfg(tmp_path: Path) -> RunConfig:
    return RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", "run_id=\"o1\"", "replicas=3"])


def _record_fails(*args: Any, **kwargs: Any) -> Any:
    raise OSError("disk full while writing run.json")


def test_a_failed_record_cancels_every_started_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = FakeExecutor(finish=False)
    monkeypatch.setattr(api, "record_launch", _record_fails)
    with pytest.raises(LaunchError, match="disk full") as info:
        launch(_cfg(tmp_path), executor=ex)
    assert "cancelled the 3 replica(s)" in str(info.value) and "nothing is left running" in str(info.value)
    assert len(ex.launched) == 1
    assert [[h["rank"] for h in batch] for batch in ex.cancelled] == [[0, 1, 2]]
    assert [h["job"] for h in ex.cancelled[0]] == ["fake-0", "fake-1", "fake-2"]  # the very replicas started


class _Uncancellable(FakeExecutor):
    def cancel(self, handles: list[dict[str, Any]]) -> None:
        raise RuntimeError("platform API down")


def test_when_cancelling_fails_too_the_error_names_the_handles(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ex = _Uncancellable(kind="fakecloud", finish=False)
    monkeypatch.setattr(api, "record_launch", _record_fails)
    with pytest.raises(LaunchError) as info:
        launch(_cfg(tmp_path), executor=ex)
    message = str(info.value)
    assert "platform API down" in message and "cancel them by hand" in message
    assert "fakecloud rank 0 (job=fake-0); rank 1 (job=fake-1); rank 2 (job=fake-2)" in message


def test_an_interrupt_while_recording_cancels_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = FakeExecutor(finish=False)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "record_launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(_cfg(tmp_path), executor=ex)
    assert len(ex.cancelled) == 1 and len(ex.cancelled[0]) == 3


def test_a_failed_launch_is_recorded_and_its_record_failure_does_not_hide_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(FakeExecutor):
        def launch_replicas(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
            raise RuntimeError("quota exceeded")

    with pytest.raises(LaunchError, match="quota exceeded"):
        launch(_cfg(tmp_path), executor=Broken())
    _, record = load_run(str(tmp_path / "runs" / "o1"), key=None)
    assert record.launch is not None and record.launch["handles"] == [] and "quota" in record.launch["error"]
    monkeypatch.setattr(api, "record_launch", _record_fails)
    with pytest.raises(LaunchError, match="quota exceeded"):  # the launch's error, not the record's
        launch(_cfg(tmp_path), executor=Broken(), overwrite=True)
