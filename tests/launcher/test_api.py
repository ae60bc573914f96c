"""The Python API (``launch``, ``Run``) and the pure pieces under the CLI: state merging, pricing,
loss curves. Local-executor behaviour with a stand-in replica (tests/support/fake_replica.py) is here too;
the real replica end to end is in test_cli_e2e.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import diloco_serverless
from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher import api, pricing
from diloco_serverless.launcher import replicas as executor_glue
from diloco_serverless.launcher.api import BudgetExceeded, Run, RunFailed, launch
from diloco_serverless.launcher.plot import curves, plot_losses
from diloco_serverless.launcher.status import (
    ExecutorState,
    ReplicaReport,
    billed_seconds,
    build_replica,
    run_state,
)
from diloco_serverless.run.record import RunNotFound
from support import FAKE_REPLICA, FIXTURES, TESTS_DIR
from support.fake_executor import FakeExecutor


def _cfg(tmp_path: Path, *sets: str) -> RunConfig:
    return RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", "run_id=\"r1\"", *sets])


# ------------------------------------------------------------------------------------ pure pieces
def test_public_exports() -> None:
    assert diloco_serverless.launch is launch
    assert diloco_serverless.Run is Run


@pytest.mark.parametrize("kind,gpu,usd", [
    ("local", None, 0.0), ("modal", "h100", 3.95), ("modal", "A100-80GB:2", 5.0), ("modal", "H100!", 3.95),
    ("modal", None, 2.10), ("hf-jobs", "a10g-large", 1.50), ("hf-jobs", None, 1.50), ("modal", "Z9", None),
])
def test_price_table(kind: str, gpu: str | None, usd: float | None) -> None:
    assert pricing.usd_per_replica_hour(kind, gpu) == (None if usd is None else pytest.approx(usd))


def test_every_executor_gpu_has_a_price() -> None:
    from huggingface_hub import JobHardware

    from diloco_serverless.executors.modal import MODAL_GPUS

    assert all(pricing.usd_per_replica_hour("modal", g) is not None for g in MODAL_GPUS)
    assert all(pricing.usd_per_replica_hour("hf-jobs", f.value) is not None for f in JobHardware)


def test_estimate_and_budget_projection() -> None:
    assert pricing.estimate_usd(3.95, [3600, 1800]) == pytest.approx(3.95 * 1.5)
    assert not pricing.would_exceed(1.0, usd_per_hour=3.6, active_replicas=2, horizon_s=10, max_usd=1.03)
    assert pricing.would_exceed(1.0, usd_per_hour=3.6, active_replicas=2, horizon_s=10, max_usd=1.02)


def test_replica_state_merging() -> None:
    now = 1000.0
    hb = {"rank": 0, "round": 3, "step": 48, "loss": 2.5, "time": now - 5, "state": "training",
          "bytes_up": 10, "bytes_down": 20}
    r = build_replica(0, ExecutorState("running"), hb, now, stale_after_s=60)
    assert (r.state, r.round, r.step, r.loss, r.bytes_moved) == ("running", 3, 48, 2.5, 30)
    assert r.heartbeat_age_s == pytest.approx(5)
    assert build_replica(0, ExecutorState("running"), hb, now + 100, 60).state == "stale"
    # no executor (e.g. Modal SDK missing here): the heartbeat decides
    assert build_replica(0, None, {**hb, "state": "done"}, now, 60).state == "succeeded"
    failed = build_replica(0, None, {**hb, "state": "failed", "message": "CUDA OOM"}, now, 60)
    assert (failed.state, failed.reason) == ("failed", "CUDA OOM")
    assert build_replica(1, None, None, now, 60).state == "pending"
    assert build_replica(1, ExecutorState("failed", "exit code 1"), hb, now, 60).reason == "exit code 1"


def _rows(*states: str) -> list[ReplicaReport]:
    return [ReplicaReport(rank=i, state=s) for i, s in enumerate(states)]


def test_run_state() -> None:
    assert run_state(_rows("succeeded", "succeeded"), 2) == "succeeded"
    assert run_state(_rows("running", "pending"), 2) == "running"
    assert run_state(_rows("pending", "pending"), 2) == "pending"
    # one rank lost: the run goes on while min_replicas can still finish, and fails at the end
    assert run_state(_rows("failed", "running", "running"), 2) == "running"
    assert run_state(_rows("failed", "running", "running"), 3) == "failed"
    assert run_state(_rows("failed", "succeeded", "succeeded"), 2) == "failed"
    assert run_state(_rows("cancelled", "cancelled"), 2) == "cancelled"


def test_billed_seconds_stop_at_last_heartbeat() -> None:
    rows = [ReplicaReport(rank=0, state="succeeded", heartbeat_age_s=40.0),
            ReplicaReport(rank=1, state="running", heartbeat_age_s=1.0)]
    assert billed_seconds(rows, 100.0) == [60.0, 100.0]


def test_curves_and_plot(tmp_path: Path) -> None:
    metrics = {0: [{"round": 0, "loss": 3.0, "eval_loss": 3.5}, {"round": 1, "loss": 2.0, "eval_loss": 2.5}],
               1: [{"round": 0, "loss": 3.2}, {"round": 1, "loss": 2.2, "eval": {"loss": 2.7}}]}
    train, evals = curves(metrics)
    assert train[1] == [(0.0, 3.2), (1.0, 2.2)]
    assert evals == [(0.0, 3.5), (1.0, pytest.approx(2.6))]  # rounds evaluated by two ranks are averaged
    png = plot_losses(metrics, tmp_path / "p.png", title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no metrics yet"):
        plot_losses({}, tmp_path / "q.png")


# ------------------------------------------------------------------------------------ launch / Run
def test_launch_with_executor_object_and_attach(tmp_path: Path) -> None:
    ex = FakeExecutor(rounds=2)
    run = launch(_cfg(tmp_path, "replicas=2", "rounds=2"), executor=ex)
    assert run.url == f"file://{tmp_path}/runs/r1"
    assert [h["rank"] for h in run.handles] == [0, 1]
    final = run.wait(poll_interval_s=0.01)
    assert final.state == "succeeded" and final.final_url == f"{run.url}/final"
    assert final.eval_loss == pytest.approx(4.7)
    again = Run.attach(run.url, executor=ex)
    assert again.status().round == 2 and again.config.rounds == 2
    assert again.logs(1, tail=1) == "rank 1 line 19\n"


def test_launch_overrides_on_a_config_object(tmp_path: Path) -> None:
    base = _cfg(tmp_path, "inner.lr=0.01", "replicas=8")
    run = launch(base, executor=FakeExecutor(), overrides=["rounds=2", "min_replicas=6"])
    cfg = run.config  # min_replicas=6 is valid against the object's 8 replicas (not the default 4)
    assert (cfg.rounds, cfg.replicas, cfg.min_replicas, cfg.inner.lr, cfg.run_id) == (2, 8, 6, 0.01, "r1")
    with pytest.raises(LaunchError, match="unknown config key 'inner.lrr'"):
        launch(base, executor=FakeExecutor(), overrides=["inner.lrr=1"])


def test_launch_on_s3(s3_store_url: str, s3_storage_options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_STORAGE_OPTIONS", json.dumps(s3_storage_options))
    ex = FakeExecutor(kind="hf-jobs", rounds=1)
    run = launch(None, executor=ex, store=s3_store_url, run_id="r1", replicas=2)
    assert run.url == f"{s3_store_url}/r1"
    assert run.wait(poll_interval_s=0.01).state == "succeeded"
    assert run.record.launch["usd_per_replica_hour"] == pricing.usd_per_replica_hour("hf-jobs", None)


def test_probe_of_missing_bucket_fails_before_creating(s3_server: str, s3_storage_options: dict,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_STORAGE_OPTIONS", json.dumps(s3_storage_options))
    ex = FakeExecutor()
    with pytest.raises(LaunchError, match="cannot use store s3://no-such-bucket-xyz"):
        launch(None, executor=ex, store="s3://no-such-bucket-xyz/runs")
    assert ex.launched == []


def test_wait_raises_run_failed_naming_ranks(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), executor=FakeExecutor(fail_ranks=(1, 3)))
    with pytest.raises(RunFailed, match="rank 1: exit code 3; rank 3: exit code 3") as info:
        run.wait(poll_interval_s=0.01)
    assert info.value.status.state == "failed"


def test_wait_cancels_before_budget(tmp_path: Path) -> None:
    ex = FakeExecutor(finish=False, usd_per_replica_hour=36.0)  # 4 replicas: $0.04 per second
    run = launch(_cfg(tmp_path), executor=ex)
    with pytest.raises(BudgetExceeded) as info:
        run.wait(poll_interval_s=0.05, max_usd=0.1)
    assert ex.cancelled, "the run must be cancelled"
    assert info.value.status.est_usd < 0.1


def test_wait_timeout_leaves_run_running(tmp_path: Path) -> None:
    ex = FakeExecutor(finish=False)
    run = launch(_cfg(tmp_path), executor=ex)
    with pytest.raises(TimeoutError, match="keeps running"):
        run.wait(timeout_s=0.05, poll_interval_s=0.01)
    assert not ex.cancelled


def test_attach_missing_run(tmp_path: Path) -> None:
    with pytest.raises(RunNotFound, match="no run at"):
        Run.attach(str(tmp_path / "nope"))


def test_attach_without_sdk_falls_back_to_heartbeats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = launch(_cfg(tmp_path), executor=FakeExecutor(kind="custom"))

    def no_sdk(launch: dict, run_url: str | None = None) -> tuple[None, str]:
        return None, "the modal executor needs the modal SDK: pip install 'diloco-serverless[modal]'"

    monkeypatch.setattr(api, "executor_from_launch", no_sdk)
    seen = Run.attach(run.url)
    assert seen.status().state == "succeeded"  # from heartbeats
    with pytest.raises(LaunchError, match=r"cannot cancel .*pip install"):
        seen.cancel()


def test_store_from_terraform(tmp_path: Path, s3_store_url: str, s3_storage_options: dict,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("diloco_serverless.launcher.terraform")
    monkeypatch.setenv("DILOCO_STORAGE_OPTIONS", json.dumps(s3_storage_options))
    outputs = json.loads((FIXTURES / "terraform_output_aws.json").read_text())
    outputs["bucket"]["value"] = s3_store_url.removeprefix("s3://")
    outputs["exchange_url"]["value"] = f"{s3_store_url}/prefix/"
    out = tmp_path / "tf.json"
    out.write_text(json.dumps(outputs))
    run = launch(None, executor=FakeExecutor(kind="hf-jobs"), store_from_terraform=out, run_id="r1")
    assert run.url == f"{s3_store_url}/prefix/r1"
    with pytest.raises(LaunchError, match="exchange_url"):
        (tmp_path / "bad.json").write_text("{}")
        launch(None, executor=FakeExecutor(), store_from_terraform=tmp_path / "bad.json")


# ------------------------------------------------------------------------------------ local executor
@pytest.fixture
def fake_entrypoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas run tests/support/fake_replica.py instead of the real trainer (fast, scripted)."""
    monkeypatch.setattr(executor_glue, "REPLICA_ENTRYPOINT", FAKE_REPLICA)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS_DIR), *sys.path]))


@pytest.mark.slow
def test_local_executor_failure_names_rank(tmp_path: Path, fake_entrypoint: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_glue, "launch_args", lambda url: ["--run-url", url, "--exit-code", "7",
                                                                    "--fail-rank", "1"])
    run = launch(_cfg(tmp_path, "replicas=2"), executor="local", executor_options={"retries": 0})
    with pytest.raises(RunFailed, match="rank 1") as info:
        run.wait(poll_interval_s=0.2, timeout_s=60)
    assert info.value.status.replicas[1].state == "failed"
    assert "exited with code 7" in str(info.value)
    assert "fails with boom" in run.logs(1)


@pytest.mark.slow
def test_local_executor_restarts_a_crashed_replica(tmp_path: Path, fake_entrypoint: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_glue, "launch_args", lambda url: ["--run-url", url, "--crash-attempts", "1"])
    run = launch(_cfg(tmp_path, "replicas=2"), executor="local",
                 executor_options={"retries": 1, "restart_delay_s": 0.1})
    assert run.wait(poll_interval_s=0.2, timeout_s=60).state == "succeeded"
    log = run.logs(1)
    assert "crashing on attempt 0" in log and "attempt=1" in log


@pytest.mark.slow
def test_local_executor_cancel_from_another_handle(tmp_path: Path, fake_entrypoint: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor_glue, "launch_args", lambda url: ["--run-url", url, "--sleep-s", "60"])
    run = launch(_cfg(tmp_path, "replicas=2"), executor="local", executor_options={"cancel_grace_s": 2.0})
    other = Run.attach(run.url)  # as `diloco cancel` would, from run.json alone
    other.cancel()
    with pytest.raises(RunFailed, match="was cancelled"):
        run.wait(poll_interval_s=0.2, timeout_s=30)
    assert [r.state for r in run.status().replicas] == ["cancelled", "cancelled"]


def test_stale_threshold_follows_round_time(tmp_path: Path) -> None:
    import time as _time

    from diloco_serverless.run.members import write_metrics

    run = launch(_cfg(tmp_path, "replicas=2", "rounds=2"), executor=FakeExecutor(rounds=1, finish=False))
    later = _time.time() + 400  # heartbeats are 400 s old by then
    assert [r.state for r in run.status(now=later).replicas] == ["stale", "stale"]
    store, _ = api.load_run(run.url)
    for rank in (0, 1):
        write_metrics(store, rank, 1, {"loss": 3.0, "wall_s": 200.0})  # slow rounds: 3 x 200 s allowed
    assert [r.state for r in run.status(now=later).replicas] == ["running", "running"]
