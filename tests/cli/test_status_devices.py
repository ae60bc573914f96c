"""`diloco status` of a run whose replicas are multi-device nodes (`parallel.devices`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.launcher import pricing
from support.fake_executor import FakeExecutor

runner = CliRunner()


@pytest.mark.parametrize(("devices", "shown"), [(2, True), (1, False)])
def test_status_shows_devices_per_replica(workdir: Path, fake: FakeExecutor, devices: int, shown: bool) -> None:
    launched = runner.invoke(app, ["launch", "--run-id", f"d{devices}", "--set", "rounds=2",
                                   "--set", f"parallel.devices={devices}"])
    assert launched.exit_code == 0, launched.output
    result = runner.invoke(app, ["status", str(workdir / "runs" / f"d{devices}")])
    assert result.exit_code == 0, result.output
    assert ("2 devices per replica" in result.stdout) is shown, result.stdout


def test_spend_counts_every_device_of_a_replica() -> None:
    one = pricing.usd_per_replica_hour("modal", "H100")
    assert one is not None and pricing.usd_per_replica_hour("modal", "H100:8") == pytest.approx(8 * one)
    h200 = pricing.usd_per_replica_hour("hf-jobs", "h200")
    assert h200 is not None and pricing.usd_per_replica_hour("hf-jobs", "h200x8") == pytest.approx(8 * h200)
