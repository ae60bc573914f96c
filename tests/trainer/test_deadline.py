"""The attempt deadline: the "continue" rule (unit, fake clock), reading it from the environment, and a real
replica (in-process ``entrypoints.replica.main``, tiny random model, file store) that stops before it with
its state saved, exits 75 and is continued by a fresh attempt from the saved round."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco_serverless.entrypoints import replica as entry
from diloco_serverless.executors.base import CONTINUE_EXIT_CODE
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.deadline import MAX_MARGIN_S, RECENT_ROUNDS, AttemptDeadline
from support.diloco_harness import create_tiny_run, write_jsonl


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------------------------------- the rule
def test_margin_is_a_tenth_of_the_attempt_at_most_five_minutes() -> None:
    assert AttemptDeadline(deadline=5.0, started_at=0.0).margin_s == pytest.approx(0.5)
    assert AttemptDeadline(deadline=86_400.0, started_at=0.0).margin_s == MAX_MARGIN_S == 300.0
    assert AttemptDeadline(deadline=0.0, started_at=10.0).margin_s == 0.0  # a deadline before the start


def test_stops_when_slowest_round_plus_save_plus_margin_would_pass_the_deadline() -> None:
    clock = Clock(1000.0)
    d = AttemptDeadline(deadline=2000.0, started_at=1000.0, clock=clock)  # margin 100 s
    assert not d.should_stop()  # no round measured yet: an attempt trains at least one
    clock.now = 1999.0
    assert not d.should_stop()
    d.record_round(200.0)  # no save measured: it counts as long as the slowest round
    clock.now = 2000.0 - 500.0  # needs 200 + 200 + 100 = 500: just fits
    assert d.next_round_s() == pytest.approx(500.0) and not d.should_stop()
    clock.now += 0.001
    assert d.should_stop()
    d.record_save(30.0)
    d.record_save(20.0)  # the longest save counts
    assert d.save_s == 30.0 and d.next_round_s() == pytest.approx(330.0)
    clock.now = 2000.0 - 330.0
    assert not d.should_stop()
    assert "slowest of the last 1 round(s) 200.0 s + state save 30.0 s + margin 100.0 s" in d.describe()


def test_only_recent_rounds_count() -> None:
    d = AttemptDeadline(deadline=10_000.0, started_at=0.0, clock=Clock(0.0))
    d.record_save(0.0)
    d.record_round(900.0)
    for _ in range(RECENT_ROUNDS - 1):
        d.record_round(10.0)
    assert d.next_round_s() == pytest.approx(900.0 + MAX_MARGIN_S)
    d.record_round(10.0)  # the slow round falls out of the window
    assert d.next_round_s() == pytest.approx(10.0 + MAX_MARGIN_S)


# ------------------------------------------------------------------------------ from the environment
def test_deadline_from_the_environment_takes_the_earlier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_ATTEMPT_DEADLINE", raising=False)
    monkeypatch.delenv("DILOCO_ATTEMPT_TIMEOUT_S", raising=False)
    assert entry._deadline(100.0) is None
    monkeypatch.setenv("DILOCO_ATTEMPT_TIMEOUT_S", "60")
    assert entry._deadline(100.0) == 160.0
    monkeypatch.setenv("DILOCO_ATTEMPT_DEADLINE", "150.5")
    assert entry._deadline(100.0) == 150.5
    monkeypatch.setenv("DILOCO_ATTEMPT_DEADLINE", "1e12")
    assert entry._deadline(100.0) == 160.0


@pytest.mark.parametrize(("name", "value"), [("DILOCO_ATTEMPT_DEADLINE", "tomorrow"),
                                             ("DILOCO_ATTEMPT_DEADLINE", "nan"),
                                             ("DILOCO_ATTEMPT_TIMEOUT_S", "-5"),
                                             ("DILOCO_ATTEMPT_TIMEOUT_S", "inf")])
def test_a_bad_deadline_is_a_setup_error_naming_the_variable(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REPLICA_RANK", "0")
    monkeypatch.setenv(name, value)
    assert entry.main(["--run-url", "file:///nonexistent/run"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err[-1].startswith("error: ") and name in err[-1] and repr(value) in err[-1], err
    assert "fix or unset it" in err[-1]


# ------------------------------------------------------------------------------ a real replica stops
def _main(monkeypatch: pytest.MonkeyPatch, url: str, *, attempt: int, deadline: float | None,
          dump: Path | None = None) -> int:
    monkeypatch.setenv("REPLICA_RANK", "0")
    monkeypatch.setenv("DILOCO_ATTEMPT", str(attempt))
    monkeypatch.setenv("DILOCO_LOG_LEVEL", "WARNING")
    monkeypatch.delenv("DILOCO_ATTEMPT_TIMEOUT_S", raising=False)
    if deadline is None:
        monkeypatch.delenv("DILOCO_ATTEMPT_DEADLINE", raising=False)
    else:
        monkeypatch.setenv("DILOCO_ATTEMPT_DEADLINE", repr(deadline))
    argv = ["--run-url", url] + (["--dump-params", str(dump)] if dump is not None else [])
    return entry.main(argv)


@pytest.mark.slow
def test_a_replica_past_its_deadline_saves_its_state_exits_75_and_a_fresh_attempt_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/a", data, 1, rounds=2, checkpoint_every=0, eval_every=0)
    store = ObjectStore(url)
    # a deadline already passed: the attempt trains its one round, then stops
    assert _main(monkeypatch, url, attempt=0, deadline=1.0) == CONTINUE_EXIT_CODE
    assert ckpt.find_latest_checkpoint(store) == 0, "the round's global checkpoint was not written"
    assert ckpt.load_replica_state(store, 0, 0) is not None, "the replica's own state was not saved"
    assert ckpt.read_data_state(store, 0, 0) is not None
    hb = store.get_json("members/rank-0.json")
    assert hb["state"] == "continuing" and hb["attempt"] == 0 and hb["round"] == 1
    assert "stopped after round 0 before its platform deadline" in hb["message"]
    assert not store.exists("final/DONE.json")

    assert _main(monkeypatch, url, attempt=1, deadline=None) == 0
    assert store.get_json("members/rank-0.json")["state"] == "done"
    trained = {m["outer_round"]: m["attempt"] for m in (store.get_json(k) for k in store.list("metrics/rank-0/"))}
    assert trained == {0: 0, 1: 1}, f"the fresh attempt did not start after the saved round: {trained}"

    # bit-identity with the run without a deadline: tests/executors/test_continue.py (2 replicas)


@pytest.mark.slow
def test_a_stop_right_after_a_scheduled_checkpoint_does_not_save_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/a", data, 1, rounds=2, checkpoint_every=1, eval_every=0)
    saves: list[int] = []
    real = ckpt.save_replica_state

    def counting(store: ObjectStore, round_: int, *args: object, **kw: object) -> None:
        saves.append(round_)
        real(store, round_, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ckpt, "save_replica_state", counting)
    assert _main(monkeypatch, url, attempt=0, deadline=1.0) == CONTINUE_EXIT_CODE
    assert saves == [0]
    assert ckpt.load_replica_state(ObjectStore(url), 0, 0) is not None
