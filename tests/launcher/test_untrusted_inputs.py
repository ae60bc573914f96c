"""The launcher against untrusted bucket content and unchecked numbers (the "trust nothing from the
bucket" issue): status merging and loss curves over malformed heartbeats and metrics (B), the budget
of ``Run.wait`` (E), and how many local replicas preflight lets one machine start (F)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher import plot, preflight
from diloco_serverless.launcher.api import launch
from diloco_serverless.launcher.status import ExecutorState, build_replica, replica_state
from support.fake_executor import FakeExecutor

HUGE = 10**400  # a JSON integer no float holds


def _cfg(tmp_path: Path, *sets: str) -> RunConfig:
    return RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", "run_id=\"r1\"", *sets])


# ------------------------------------------------------------------------------------ B: status
@pytest.mark.parametrize("field,value,why", [
    ("round", "x", "is not an integer"),
    ("round", math.inf, "is not an integer"),
    ("round", [1], "is not an integer"),
    ("round", True, "is not an integer"),
    ("round", -3, "is out of range"),
    ("step", 2.5, "is not an integer"),
    ("loss", "abc", "is not a number"),
    ("loss", {"v": 1}, "is not a number"),
    ("loss", HUGE, "is out of range"),
    ("attempt", "1", "is not an integer"),
    ("time", "yesterday", "is not a timestamp"),
    ("time", math.nan, "is not a timestamp"),
    ("bytes_up", "lots", "is not an integer"),
    ("bytes_down", HUGE, "is out of range"),
    ("state", ["done"], "is not a string"),
    ("message", 42, "is not a string"),
], ids=lambda v: "10**400" if v == HUGE else None)
def test_build_replica_reports_a_malformed_field_instead_of_raising(field: str, value: object, why: str) -> None:
    """B: any JSON type in any heartbeat field gives an unknown value and a note, never an exception."""
    hb = {"rank": 2, "round": 3, "step": 12, "loss": 1.5, "attempt": 0, "time": 90.0, "state": "training",
          "bytes_up": 10, "bytes_down": 20, field: value}
    r = build_replica(2, None, hb, now=100.0, stale_after_s=300.0)
    assert r.invalid == frozenset({field})
    assert r.notes == (f"rank 2: heartbeat field '{field}' {why}",)
    if field in ("round", "step", "loss", "attempt"):
        assert getattr(r, field) is None
    assert r.state in ("running", "pending")


def test_build_replica_keeps_what_the_heartbeat_parser_marked() -> None:
    """B: a field ``Heartbeat.from_json_dict`` already found unusable (None + ``invalid``) stays noted."""
    hb = {"rank": 1, "round": None, "loss": None, "time": 50.0, "state": "done",
          "invalid": {"round": "is not an integer", "bogus": "x", "loss": 7}}
    r = build_replica(1, None, hb, now=100.0, stale_after_s=300.0)
    assert (r.state, r.round, r.invalid) == ("succeeded", None, frozenset({"round"}))
    assert r.notes == ("rank 1: heartbeat field 'round' is not an integer",)


def test_heartbeat_reason_must_be_text() -> None:
    """B: a non-string message/error/reason is not shown as the reason (it would crash the table)."""
    state, reason = replica_state(None, {"state": "failed", "message": ["x"], "error": "oom"}, 1.0, 300.0)
    assert (state, reason) == ("failed", "oom")
    assert replica_state(None, {"state": {"a": 1}}, 1.0, 300.0) == ("running", None)
    assert replica_state(ExecutorState("running"), {"state": 5}, 1.0, 300.0) == ("running", None)


# ------------------------------------------------------------------------------------ B: curves and plot
def test_curves_and_plot_skip_malformed_metrics(tmp_path: Path) -> None:
    """B: a 400-digit round, string losses and lists are left out of the curves (and named), not raised."""
    metrics = {
        0: [{"rank": 0, "round": 0, "loss": 2.0, "eval_loss": 2.5},
            {"rank": 0, "round": HUGE, "loss": HUGE, "eval_loss": [1]},
            {"rank": 0, "round": 2, "loss": "abc", "lm_ce": "nan"}],
        1: [{"rank": 1, "round": "x", "step": math.inf, "loss": 1.5}],
    }
    train, evals = plot.curves(metrics)
    assert train == {0: [(0.0, 2.0)], 1: [(0.0, 1.5)]}  # rank 1's x falls back to the record's index
    assert evals == [(0.0, 2.5)]
    assert plot.metrics_notes(metrics) == [
        "rank 0: metrics field 'round' is not an integer",
        "rank 0: metrics field 'loss' of a record is not a number",
        "rank 0: metrics field 'eval_loss' of a record is not a number",
        "rank 0: metrics field 'loss' of round 2 is not a number",  # "nan" is a diverged loss, not malformed
        "rank 1: metrics field 'round' is not an integer",
    ]
    png = plot.plot_losses(metrics, tmp_path / "loss.png", title="r1 $\\frac{$ \x1b[31m")  # no mathtext, no escapes
    assert png.read_bytes().startswith(b"\x89PNG")


def test_metrics_notes_are_bounded() -> None:
    metrics = {0: [{"rank": 0, "round": i, "loss": "x"} for i in range(50)]}
    notes = plot.metrics_notes(metrics)
    assert len(notes) == 10 and notes[-1] == "... and 41 more unusable metrics fields"


# ------------------------------------------------------------------------------------ E: budget
@pytest.mark.parametrize("max_usd", [math.nan, math.inf, 0.0, -5.0])
def test_wait_refuses_a_budget_that_can_never_trigger(tmp_path: Path, max_usd: float) -> None:
    """E: ``Run.wait(max_usd=nan)`` used to poll forever with the guard silently off."""
    ex = FakeExecutor(finish=False, usd_per_replica_hour=3600.0)
    run = launch(_cfg(tmp_path), executor=ex)
    with pytest.raises(LaunchError, match=r"^max_usd must be positive and finite, in US dollars .*max_usd=20$"):
        run.wait(timeout_s=0.3, poll_interval_s=0.01, max_usd=max_usd)
    assert not ex.cancelled


def test_check_max_usd() -> None:
    assert preflight.check_max_usd(5, "--max-usd") == 5.0
    with pytest.raises(LaunchError, match="--max-usd must be a number of US dollars, got str"):
        preflight.check_max_usd("5", "--max-usd")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match=r"--max-usd must be positive and finite.*\(got nan\); e\.g\. --max-usd 20"):
        preflight.check_max_usd(math.nan, "--max-usd")


# ------------------------------------------------------------------------------------ F: local capacity
def test_local_replica_limit_by_cores_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """F: 4 replicas per usable core, and no more than the available memory holds at ~512 MiB each."""
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    monkeypatch.setattr(preflight, "available_memory", lambda: 64 * 2**30)
    assert preflight.local_replica_limit() == (8, "2 usable CPU cores hold at most 8 (4 per core)")
    preflight.check_local_capacity(8)
    with pytest.raises(LaunchError, match=r"^--replicas 2000 is more local replicas than this machine holds: "
                                          r"2 usable CPU cores hold at most 8 .*-x oversubscribe=true"):
        preflight.check_local_capacity(2000)
    preflight.check_local_capacity(2000, oversubscribe=True)
    monkeypatch.setattr(preflight, "usable_cores", lambda: 64)
    monkeypatch.setattr(preflight, "available_memory", lambda: 2**30)
    with pytest.raises(LaunchError, match=r"1\.0 GiB of available memory holds at most 2 \(~512 MiB each\)"):
        preflight.check_local_capacity(3)
    monkeypatch.setattr(preflight, "available_memory", lambda: None)  # unknown: the core rule alone
    preflight.check_local_capacity(256)


def test_launch_api_refuses_too_many_local_replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F: the Python API checks too, before the run is created; executor_options overrides it."""
    monkeypatch.setattr(preflight, "usable_cores", lambda: 1)
    monkeypatch.setattr(preflight, "available_memory", lambda: 64 * 2**30)
    ex = FakeExecutor(kind="local")
    with pytest.raises(LaunchError, match="1 usable CPU core holds at most 4"):
        launch(_cfg(tmp_path), executor=ex, replicas=5)
    assert ex.launched == [] and not (tmp_path / "runs" / "r1").exists()
    run = launch(_cfg(tmp_path), executor=ex, replicas=5, executor_options={"oversubscribe": True})
    assert run.config.replicas == 5 and ex.launched[0]["n"] == 5
    with pytest.raises(LaunchError, match="-x oversubscribe must be true or false"):
        preflight.check_launch(_cfg(tmp_path), "local", executor_options={"oversubscribe": "yes"})


def test_status_survives_forged_metrics_records(tmp_path: Path) -> None:
    """A metrics record's body does not decide whose record it is, and its numbers may be anything."""
    from diloco_serverless.store.objectstore import ObjectStore

    run = launch(_cfg(tmp_path), executor=FakeExecutor())
    store = ObjectStore(run.url)
    store.put("metrics/rank-0/00000000.json", json.dumps({"rank": "x", "round": 0, "wall_s": "slow"}).encode())
    store.put("metrics/rank-1/00000000.json", json.dumps({"rank": 10**400, "round": 0, "wall_s": 10**400}).encode())
    store.put("metrics/not-a-rank/00000000.json", b"{}")
    ranks = set(run.metrics())
    assert {0, 1} <= ranks and all(isinstance(r, int) and 0 <= r < 10 for r in ranks)
    assert run.status().replicas[0].rank == 0


def test_a_deeply_nested_run_json_is_an_invalid_run(tmp_path: Path) -> None:
    from diloco_serverless.run.record import InvalidRun, load_run
    from diloco_serverless.store.objectstore import ObjectStore

    store = ObjectStore(str(tmp_path / "store" / "run-deep"))
    store.put("run.json", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(InvalidRun, match="not valid JSON"):
        load_run(store)
