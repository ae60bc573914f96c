"""``--store-timeout``: every command that touches the store ends within its deadline when the endpoint
accepts connections and never answers, with one ``error:`` line naming the URL (exit 2).

The endpoint is a real socket server on 127.0.0.1 (:class:`SilentEndpoint`), reached through s3://
with a custom endpoint, in process (typer's runner) and as a real ``diloco`` process."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import INTERACTIVE_STORE_TIMEOUT_S, app
from diloco_serverless.launcher import api, preflight
from diloco_serverless.store.objectstore import ENV_STORAGE_OPTIONS
from support import REPO_ROOT
from support.fake_executor import FakeExecutor
from support.silent_endpoint import SilentEndpoint

runner = CliRunner()
cli_app = importlib.import_module("diloco_serverless.cli.app")  # the module; the package exports the app

#: Long enough for a loaded 2-core machine to build the S3 client and connect before it passes (at 2 s the
#: deadline sometimes ran out first, and the endpoint never saw the connection the test checks for).
DEADLINE_S = 5
#: What "finishes within the deadline" allows on a loaded 2-core machine: the deadline, the client's
#: start-up and one backoff sleep; a command that waits the 300 s default (or 30 s) fails it.
BOUND_S = 20.0
BUCKET_URL = "s3://diloco-silent/runs"
RUN_URL = f"{BUCKET_URL}/run-x"


@pytest.fixture
def silent() -> Iterator[SilentEndpoint]:
    endpoint = SilentEndpoint()
    try:
        yield endpoint
    finally:
        endpoint.close()


def _aws_env(endpoint: str | None) -> dict[str, str]:
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    if endpoint is not None:
        env["AWS_ENDPOINT_URL"] = endpoint
    return env


@pytest.fixture
def silent_s3(silent: SilentEndpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SilentEndpoint:
    """In-process: s3:// reaches the silent endpoint (DILOCO_STORAGE_OPTIONS, dummy credentials)."""
    pytest.importorskip("s3fs")
    monkeypatch.chdir(tmp_path)
    for name, value in _aws_env(None).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(ENV_STORAGE_OPTIONS, json.dumps({"endpoint_url": silent.url, "skip_instance_cache": True}))
    _warm_s3_client(silent.url)
    return silent


def _warm_s3_client(endpoint: str) -> None:
    """Build (and drop) one S3 client before the timed command: its first build imports botocore and
    loads the service model, which on a loaded 2-core machine can take most of a 2 s deadline before a
    single connection is made. No request is sent."""
    import botocore.session

    botocore.session.get_session().create_client(
        "s3", region_name="us-east-1", endpoint_url=endpoint, aws_access_key_id="testing",
        aws_secret_access_key="testing").close()


COMMANDS = {
    "status": ["status", RUN_URL],
    "logs": ["logs", RUN_URL],
    "cancel": ["cancel", RUN_URL],
    "plot": ["plot", RUN_URL, "-o", "loss.png"],
    "ls": ["ls", BUCKET_URL],
    "launch": ["launch", "--store", BUCKET_URL, "--run-id", "run-x", "--replicas", "1", "--detach"],
}


def _assert_one_error_line(stderr: str, *names: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    for name in names:
        assert name in lines[0], (name, stderr)
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.slow  # waits out a real deadline (seconds): kept out of the fast tier
@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_unresponsive_store_ends_each_command_within_its_deadline(
        command: str, silent_s3: SilentEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeExecutor()
    monkeypatch.setattr(preflight, "build_executor", lambda kind, gpu, options: fake)
    start = time.monotonic()
    result = runner.invoke(app, [*COMMANDS[command], "--store-timeout", str(DEADLINE_S)])
    elapsed = time.monotonic() - start
    assert result.exit_code == 2, result.output
    line = _assert_one_error_line(result.stderr, BUCKET_URL, silent_s3.url, f"{DEADLINE_S} s deadline")
    assert elapsed < BOUND_S, f"{command} took {elapsed:.1f} s with --store-timeout {DEADLINE_S}: {line}"
    assert silent_s3.wait_accepted() >= 1  # it reached the endpoint and waited; nothing refused the connection
    assert fake.launched == []  # launch failed in preflight: no replica started


@pytest.mark.slow  # waits out a real deadline (seconds): kept out of the fast tier
@pytest.mark.timeout(120)
def test_unresponsive_store_real_process_exits_with_one_line(silent: SilentEndpoint, tmp_path: Path) -> None:
    """A real ``diloco status`` process, the endpoint from AWS_ENDPOINT_URL: it prints one line and exits
    (no thread or connection left behind keeps it alive)."""
    pytest.importorskip("s3fs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DILOCO_STORAGE"))}
    env.update(_aws_env(silent.url))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "diloco_serverless.cli", "status", RUN_URL,
                           "--store-timeout", str(DEADLINE_S)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    _assert_one_error_line(proc.stderr, f"{RUN_URL}/run.json", silent.url)
    assert elapsed < BOUND_S, f"diloco status took {elapsed:.1f} s with --store-timeout {DEADLINE_S}"
    assert silent.wait_accepted() >= 1


# ------------------------------------------------------------------------------ the option itself
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_store_command_offers_store_timeout(command: str) -> None:
    result = runner.invoke(app, [COMMANDS[command][0], "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--store-timeout" in result.output


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_bad_store_timeout_is_one_line(command: str, value: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = [a if a not in (BUCKET_URL, RUN_URL) else a.replace(BUCKET_URL, str(tmp_path / "runs"))
            for a in COMMANDS[command]]
    result = runner.invoke(app, [*args, f"--store-timeout={value}"])
    assert result.exit_code == 2, result.output
    _assert_one_error_line(result.stderr, "--store-timeout must be a positive, finite number of seconds")
    assert not (tmp_path / "runs").exists()


def _fake(monkeypatch: pytest.MonkeyPatch) -> FakeExecutor:
    ex = FakeExecutor()
    monkeypatch.setattr(preflight, "build_executor", lambda kind, gpu, options: ex)
    monkeypatch.setattr(api, "executor_from_launch", lambda launch, run_url=None: (ex, None))
    return ex


def test_launch_store_timeout_sets_the_config_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _fake(monkeypatch)
    result = runner.invoke(app, ["launch", "--run-id", "r1", "--set", "rounds=3", "--store-timeout", "7.5"])
    assert result.exit_code == 0, result.output
    stored = json.loads((tmp_path / "runs" / "r1" / "run.json").read_text())
    assert stored["config"]["store_timeout_s"] == 7.5  # what the replicas read
    result = runner.invoke(app, ["launch", "--run-id", "r2", "--set", "rounds=3", "--set", "store_timeout_s=9"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "runs" / "r2" / "run.json").read_text())["config"]["store_timeout_s"] == 9


@pytest.mark.parametrize("command", ["status", "logs", "cancel", "plot", "ls"])
def test_reading_commands_default_to_the_interactive_deadline(command: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --store-timeout the read commands bound every store operation by 30 s, not the
    run's store_timeout_s (60 s by default) nor RetryPolicy's 300 s; with it, by the value given."""
    monkeypatch.chdir(tmp_path)
    _fake(monkeypatch)
    assert runner.invoke(app, ["launch", "--run-id", "r1", "--set", "rounds=3"]).exit_code == 0
    seen: list[float] = []
    real_status = api.Run.status

    def spy(self: api.Run, **kwargs: Any) -> Any:
        seen.append(self._store.retry.timeout_s)
        return real_status(self, **kwargs)

    monkeypatch.setattr(api.Run, "status", spy)
    real_list_runs = cli_app.list_runs

    def spy_list(root: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(root.retry.timeout_s)
        return real_list_runs(root, *args, **kwargs)

    monkeypatch.setattr(cli_app, "list_runs", spy_list)
    real_logs = api.Run.logs

    def spy_logs(self: api.Run, *args: Any, **kwargs: Any) -> Any:
        seen.append(self._store.retry.timeout_s)
        return real_logs(self, *args, **kwargs)

    monkeypatch.setattr(api.Run, "logs", spy_logs)
    real_metrics = api.Run.metrics

    def spy_metrics(self: api.Run) -> Any:
        seen.append(self._store.retry.timeout_s)
        return real_metrics(self)

    monkeypatch.setattr(api.Run, "metrics", spy_metrics)
    args = {"status": ["status", "r1"], "logs": ["logs", "r1"], "cancel": ["cancel", "r1"],
            "plot": ["plot", "r1", "-o", str(tmp_path / "loss.png")], "ls": ["ls"]}[command]
    assert runner.invoke(app, args).exit_code == 0
    assert seen and set(seen) == {INTERACTIVE_STORE_TIMEOUT_S}
    seen.clear()
    assert runner.invoke(app, [*args, "--store-timeout", "4"]).exit_code == 0
    assert seen and set(seen) == {4.0}
