"""Experiment tracking (diloco_serverless.tracking): the per-round series, when a round is logged, and each
backend end to end and offline: a run launched with the fake executor and followed by ``Run.wait`` is
read back from TensorBoard's event files, W&B's offline run file and trackio's local database.

A backend's test is skipped only when its package is not installed."""

from __future__ import annotations

import json
import logging
import struct
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher import api
from diloco_serverless.launcher.api import Run, launch
from diloco_serverless.run.members import write_metrics
from diloco_serverless.run.record import load_run
from diloco_serverless.tracking import GLOBAL_KEYS, TOTAL_KEYS, Tracker, TrackingError, global_values
from diloco_serverless.tracking import tracker as tracker_module
from diloco_serverless.tracking.tracker import wandb_run_id
from support.fake_executor import FakeExecutor

N, ROUNDS = 2, 3


def record(rank: int, rnd: int, n: int = N) -> dict[str, Any]:
    """A metrics record as trainer/loop.py writes it (rank 0 also evaluates)."""
    rec: dict[str, Any] = {
        "attempt": 0, "fragment": 0, "outer_round": rnd, "committed": True, "inner_steps": 4,
        "inner_step_total": 4 * (rnd + 1), "total": 5.0 - 0.5 * rnd + 0.1 * rank, "lm_ce": 4.0 - 0.5 * rnd + 0.1 * rank,
        "sdpo_jsd": 0.2, "trace_replay_dpo": 0.7, "tokens": 1000, "tokens_per_s": 500.0, "wall_s": 4.0,
        "inner_s": 2.0, "wait_s": 2.0, "data_wait_s": 0.4, "lr": 3e-3, "exchange_s": 1.5, "bytes_up": 1000,
        "bytes_down": 1500, "participants": list(range(n)), "late": False, "error": None, "abstained": None,
    }
    if rank == 0:
        rec["eval_loss"] = 4.5 - 0.5 * rnd
    return rec


class RealisticExecutor(FakeExecutor):
    """FakeExecutor whose replicas leave trainer-shaped metrics records (see :func:`record`)."""

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        handles = super().launch_replicas(n_replicas, entrypoint, entrypoint_args, env)
        store, _ = load_run((env or {})["DILOCO_RUN_URL"])
        for rank in range(n_replicas):
            for rnd in range(self.rounds):
                write_metrics(store, rank, rnd, record(rank, rnd, n_replicas))
        return handles


def _cfg(tmp_path: Path, *sets: str) -> RunConfig:
    return RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="r1"', f"replicas={N}",
                                 f"rounds={ROUNDS}", *sets])


def _tb_dir(tmp_path: Path) -> str:
    return f"tracking.tensorboard_dir={json.dumps(str(tmp_path / 'tb'))}"


def _run(tmp_path: Path, *sets: str) -> Run:
    """A finished run (fake replicas), followed to the end by Run.wait, which tracks it."""
    run = launch(_cfg(tmp_path, *sets), RealisticExecutor(rounds=ROUNDS))
    assert run.wait(poll_interval_s=0.01).state == "succeeded"
    return run


# ------------------------------------------------------------------------------------ the series
def test_global_values_of_one_round() -> None:
    point = global_values({0: record(0, 1), 1: record(1, 1)})
    assert point["loss/total"] == pytest.approx(4.55)            # mean over ranks
    assert point["loss/lm_ce"] == pytest.approx(3.55)
    assert point["loss/sdpo_jsd"] == pytest.approx(0.2) and point["loss/trace_replay_dpo"] == pytest.approx(0.7)
    assert point["eval/loss"] == pytest.approx(4.0)              # rank 0's
    assert point["throughput/tokens"] == 2000 and point["throughput/tokens_per_s"] == 1000  # sums: the run's
    assert point["exchange/bytes_moved"] == 5000 and point["exchange/bytes_up"] == 2000
    assert point["exchange/seconds"] == pytest.approx(1.5) and point["exchange/wait_s"] == pytest.approx(2.0)
    assert point["utilisation/compute"] == pytest.approx(0.5)     # inner_s / wall_s over the replicas
    assert point["utilisation/data_wait"] == pytest.approx(0.1)
    assert point["replicas/participants"] == 2 and point["replicas/reporting"] == 2
    assert point["replicas/abstained"] == 0 and point["replicas/late"] == 0
    assert point["optim/inner_lr"] == pytest.approx(3e-3) and point["outer_round"] == 1
    assert set(point) == set(GLOBAL_KEYS)


def test_values_from_the_bucket_are_never_trusted() -> None:
    bad = {**record(1, 0), "total": "nan", "tokens": "many", "bytes_up": True, "wall_s": 1e400, "participants": "all"}
    point = global_values({0: record(0, 0), 1: bad})
    assert point["loss/total"] == pytest.approx(5.0)  # rank 1's unusable loss is left out, not averaged in
    assert point["throughput/tokens"] == 1000 and point["exchange/bytes_up"] == 1000
    assert point["replicas/participants"] == 2  # rank 0's record names them


class Recorder:
    """A backend that keeps what it was given."""

    name = "recorder"

    def __init__(self, fail_after: int | None = None) -> None:
        self.points: list[tuple[int, dict[str, float]]] = []
        self.summaries: list[dict[str, Any]] = []
        self.closed = False
        self.fail_after = fail_after

    def log(self, values: Mapping[str, float], step: int) -> None:
        if self.fail_after is not None and len(self.points) >= self.fail_after:
            raise ConnectionError("tracker server went away")
        self.points.append((step, dict(values)))

    def summary(self, values: Mapping[str, Any], step: int) -> None:
        self.summaries.append(dict(values))

    def close(self) -> None:
        self.closed = True


def _metrics(*rounds: tuple[int, list[int]], n: int = 3) -> dict[int, list[dict[str, Any]]]:
    """Metrics grouped by rank: ``(round, ranks that wrote it)``; every round's quorum is all ``n``."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rnd, ranks in rounds:
        for rank in ranks:
            out.setdefault(rank, []).append({"round": rnd, **record(rank, rnd, n)})
    return out


def test_a_round_is_logged_once_every_participant_wrote_it_and_steps_only_grow() -> None:
    rec = Recorder()
    tracker = Tracker([rec], replicas=3)
    assert tracker.update(_metrics((0, [0, 1]))) == 0            # rank 2 has not written round 0 yet
    assert tracker.update(_metrics((0, [0, 1, 2]), (1, [0]))) == 1
    assert [s for s, _ in rec.points] == [0]
    # round 1 stays incomplete, but round 3 exists: a participant died after contributing to 1
    assert tracker.update(_metrics((0, [0, 1, 2]), (1, [0]), (2, [0, 1]), (3, [0]))) == 1
    assert [s for s, _ in rec.points] == [0, 1]
    assert tracker.update(_metrics((0, [0, 1, 2]), (1, [0]), (2, [0, 1]), (3, [0])), done=True) == 2
    assert [s for s, _ in rec.points] == [0, 1, 2, 3]
    assert rec.points[1][1]["replicas/reporting"] == 1 and rec.points[1][1]["replicas/participants"] == 3
    totals = [p["throughput/tokens_total"] for _, p in rec.points]
    assert totals == [3000, 4000, 6000, 7000]  # running totals over the rounds logged
    assert all(k in rec.points[-1][1] for k in TOTAL_KEYS)
    assert tracker.update(_metrics((0, [0, 1, 2])), done=True) == 0  # nothing is logged twice
    tracker.finish({"final/eval_loss": 2.5, "final/state": "succeeded", "final/est_usd": None})
    assert rec.summaries == [{"final/eval_loss": 2.5, "final/state": "succeeded"}] and rec.closed


def test_per_replica_series() -> None:
    rec = Recorder()
    Tracker([rec], replicas=2, per_replica=True).update(_metrics((0, [0, 1]), n=2))
    point = rec.points[0][1]
    assert point["replica/1/loss"] == pytest.approx(5.1) and point["replica/0/lm_ce"] == pytest.approx(4.0)
    assert point["replica/0/bytes_moved"] == 2500 and point["replica/1/utilisation"] == pytest.approx(0.5)
    assert point["replica/0/tokens_per_s"] == 500 and point["replica/1/exchange_s"] == pytest.approx(1.5)
    plain = Recorder()
    Tracker([plain], replicas=2).update(_metrics((0, [0, 1]), n=2))
    assert not any(k.startswith("replica/") for k in plain.points[0][1])  # off by default


def test_a_failing_backend_is_dropped_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    broken, fine = Recorder(fail_after=1), Recorder()
    tracker = Tracker([broken, fine], replicas=2)
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.tracking"):
        assert tracker.update(_metrics((0, [0, 1]), (1, [0, 1]), (2, [0, 1]), n=2)) == 3
    assert [s for s, _ in fine.points] == [0, 1, 2] and [s for s, _ in broken.points] == [0]
    assert broken.closed and tracker.names == ["recorder"]
    assert "tracking: recorder failed (tracker server went away)" in caplog.text


def test_wait_tracks_with_a_backend_that_breaks_and_the_run_still_succeeds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = Recorder(fail_after=0)
    monkeypatch.setattr(Tracker, "open", classmethod(lambda cls, cfg, run_url=None: cls([broken], replicas=N)))
    monkeypatch.setattr(api, "check_backends", lambda tracking: None)
    run = launch(_cfg(tmp_path, "tracking.backends=tensorboard"), RealisticExecutor(rounds=ROUNDS))
    assert run.wait(poll_interval_s=0.01).state == "succeeded"
    assert broken.closed


def test_a_tracker_that_cannot_start_does_not_stop_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    def refuse(cls: Any, cfg: Any, run_url: Any = None) -> Tracker:
        raise TrackingError("tracking backend wandb could not start: 401 Unauthorized")

    monkeypatch.setattr(api, "check_backends", lambda tracking: None)
    run = launch(_cfg(tmp_path, "tracking.backends=wandb"), RealisticExecutor(rounds=ROUNDS))
    monkeypatch.setattr(Tracker, "open", classmethod(refuse))
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.launcher"):
        assert run.wait(poll_interval_s=0.01).state == "succeeded"
    assert "tracking is off for run r1" in caplog.text and "401 Unauthorized" in caplog.text


# ------------------------------------------------------------------------------------ preflight
def test_a_missing_tracker_package_is_refused_before_anything_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracker_module, "missing_packages", lambda backends: [b for b in backends if b == "wandb"])
    ex = RealisticExecutor()
    with pytest.raises(LaunchError, match=r"names 'wandb', but the wandb package is not installed here; "
                                          r"pip install 'diloco-serverless\[wandb\]'"):
        launch(_cfg(tmp_path, "tracking.backends=[\"tensorboard\", \"wandb\"]"), ex)
    assert ex.launched == [] and not (tmp_path / "runs" / "r1").exists()


def test_wandb_online_without_a_login_is_refused_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracker_module, "missing_packages", lambda backends: [])
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("machine example.com login x password y\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    ex = RealisticExecutor()
    with pytest.raises(LaunchError, match="W&B has no login here: run `wandb login` or export WANDB_API_KEY"):
        launch(_cfg(tmp_path, "tracking.backends=wandb"), ex)
    assert ex.launched == []
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k\n")  # what `wandb login` writes
    tracker_module.check_backends(_cfg(tmp_path, "tracking.backends=wandb").tracking)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker_module.check_backends(_cfg(tmp_path, "tracking.backends=wandb").tracking)


def test_track_without_backends_says_how_to_configure_them(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), RealisticExecutor(rounds=ROUNDS))
    with pytest.raises(TrackingError, match="launch with --set tracking.backends=trackio"):
        run.track()


# ------------------------------------------------------------------------------------ TensorBoard
def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    run = _run(tmp_path, "tracking.backends=tensorboard", _tb_dir(tmp_path), "tracking.per_replica=true")
    events = EventAccumulator(str(tmp_path / "tb" / "r1"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert set(GLOBAL_KEYS) | set(TOTAL_KEYS) <= scalars and "replica/1/loss" in scalars

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(tag)]

    assert series("loss/total") == [(r, 5.05 - 0.5 * r) for r in range(ROUNDS)]
    assert series("eval/loss") == [(r, 4.5 - 0.5 * r) for r in range(ROUNDS)]
    assert series("exchange/bytes_moved_total") == [(r, 5000.0 * (r + 1)) for r in range(ROUNDS)]
    assert series("final/tokens") == [(ROUNDS - 1, 2000.0 * ROUNDS)]

    def text(tag: str) -> str:
        return tensor_util.make_ndarray(events.Tensors(tag)[0].tensor_proto).item().decode()

    config = json.loads(text("config").removeprefix("```json\n").removesuffix("\n```"))
    assert {k: v for k, v in config.items() if k != "run_url"} == run.config.to_json_dict()
    assert config["run_url"] == run.url
    assert "| final/state | succeeded |" in text("summary")


# ------------------------------------------------------------------------------------ W&B (offline)
def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B offline run file (``run-<id>.wandb``): a 7-byte header, then LevelDB-log
    framed protobuf ``Record``s in 32 KiB blocks (W&B's own reader left the Python package)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", "not a W&B run file"
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + 7 + length > len(raw):
            break  # W&B's service is still writing this record: read it on the next poll
        data, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
        if zlib.crc32(data, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != _crc:
            break  # a record whose bytes are not all on disk yet
        if kind == 1:
            out.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            out.append(pending + data)
            pending = b""
    records = []
    for data in out:
        rec = pb.Record()
        rec.ParseFromString(data)
        records.append(rec)
    return records


def _finished_wandb_records(path: Path, timeout_s: float = 30.0) -> list[Any]:
    """The records of an offline run file once its ``exit`` record is there: ``run.finish()`` returns
    before W&B's service process has flushed the file."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B in offline mode under ``tmp_path/wandb``; its process-wide setup is torn down around the
    test, so that it reads this test's environment."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()
    yield tmp_path / "wandb"
    wandb.teardown()


def test_wandb_offline_run_reads_back(tmp_path: Path, wandb_offline: Path) -> None:
    run = _run(tmp_path, "tracking.backends=wandb", 'tracking.project="diloco-tests"')
    files = list(wandb_offline.glob(f"offline-run-*-{wandb_run_id('r1')}/run-{wandb_run_id('r1')}.wandb"))
    assert len(files) == 1, list(wandb_offline.iterdir())
    records = _finished_wandb_records(files[0])
    kinds = [r.WhichOneof("record_type") for r in records]
    header = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (header.run_id, header.display_name, header.project) == ("r1", "r1", "diloco-tests")
    config = {u.key: json.loads(u.value_json) for u in header.config.update if u.key != "_wandb"}
    assert {k: v for k, v in config.items() if k != "run_url"} == run.config.to_json_dict()
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == list(range(ROUNDS))
    assert [h["loss/total"] for h in history] == pytest.approx([5.05 - 0.5 * r for r in range(ROUNDS)])
    assert [h["replicas/participants"] for h in history] == [N] * ROUNDS
    assert history[-1]["exchange/bytes_moved_total"] == 5000 * ROUNDS
    summary = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for r in records
               if r.WhichOneof("record_type") == "summary" for u in r.summary.update}
    assert summary["final/eval_loss"] == pytest.approx(4.5 - 0.5 * (ROUNDS - 1))
    assert summary["final/state"] == "succeeded" and summary["final/tokens"] == 2000 * ROUNDS
    assert "exit" in kinds  # finished: the run file is complete, ready for `wandb sync`


# ------------------------------------------------------------------------------------ trackio (local)
def test_trackio_local_database_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("trackio")
    from trackio import sqlite_storage

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")  # read at import from $TRACKIO_DIR
    run = _run(tmp_path, "tracking.backends=trackio", 'tracking.project="diloco-tests"', "tracking.per_replica=true")
    assert (tmp_path / "trackio" / "diloco-tests.db").is_file()
    logs = sqlite_storage.SQLiteStorage.get_logs("diloco-tests", "r1")
    rounds = [row for row in logs if "loss/total" in row]
    assert [row["step"] for row in rounds] == list(range(ROUNDS))
    assert [row["loss/total"] for row in rounds] == pytest.approx([5.05 - 0.5 * r for r in range(ROUNDS)])
    assert [row["utilisation/compute"] for row in rounds] == pytest.approx([0.5] * ROUNDS)
    assert rounds[0]["replica/1/loss"] == pytest.approx(5.1)
    assert any(row.get("final/eval_loss") == pytest.approx(3.5) for row in logs)
    config = sqlite_storage.SQLiteStorage.get_run_config("diloco-tests", "r1")
    assert config is not None
    assert {k: v for k, v in config.items() if not k.startswith("_") and k != "run_url"} == run.config.to_json_dict()


def test_track_logs_a_detached_run(tmp_path: Path) -> None:
    """``Run.track`` (``diloco track``) for a run nobody followed while it ran."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(tmp_path, "tracking.backends=tensorboard", _tb_dir(tmp_path))
    run = launch(cfg, RealisticExecutor(rounds=ROUNDS))  # detached: nobody waits, nothing is tracked yet
    assert not (tmp_path / "tb").exists()
    final = api.Run.attach(run.url).track(follow=True, poll_interval_s=0.01)
    assert final.state == "succeeded"
    events = EventAccumulator(str(tmp_path / "tb" / "r1"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("loss/total")] == list(range(ROUNDS))


def test_simulated_runs_without_component_losses_still_have_a_loss_series() -> None:
    """Records that name the loss ``loss`` (other writers, tests/support/fake_executor.py) count as the total."""
    rec = Recorder()
    Tracker([rec], replicas=2).update({0: [{"round": 0, "loss": 3.0}], 1: [{"round": 0, "loss": 4.0}]})
    assert rec.points[0][1]["loss/total"] == pytest.approx(3.5)
