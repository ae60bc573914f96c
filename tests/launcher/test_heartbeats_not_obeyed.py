"""Finding 5: a forged heartbeat never starts, restarts or ends anything while the executor answers "unknown"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.launcher.api import launch
from diloco_serverless.run.members import Heartbeat, write_heartbeat
from diloco_serverless.run.record import load_run
from support.fake_executor import FakeExecutor


class UnknownExecutor(FakeExecutor):
    """The platform has forgotten every replica: each poll answers "unknown"."""

    def poll(self, handles: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"rank": h["rank"], "state": "unknown"} for h in handles]


@pytest.mark.parametrize("forged", ["continuing", "failed", "done"])
def test_a_forged_heartbeat_state_is_shown_not_obeyed(tmp_path: Path, forged: str) -> None:
    cfg = RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="r1"', "replicas=2",
                                "rounds=3"])
    ex = UnknownExecutor(rounds=3, finish=False)
    run = launch(cfg, ex)
    store, _ = load_run(run.url)
    write_heartbeat(store, Heartbeat(rank=1, round=1, step=4, state=forged))  # the co-tenant
    status = run.status()
    assert status.replicas[1].from_heartbeat  # shown as the heartbeat says, marked as such
    with pytest.raises(TimeoutError):
        run.wait(timeout_s=0.3, poll_interval_s=0.05, track=False)
    assert len(ex.launched) == 1, "a heartbeat saying 'continuing' started another replica"
    assert not ex.cancelled


def test_spend_never_drops_when_members_are_deleted(tmp_path: Path) -> None:
    """Finding 7: deleting members/ (heartbeats and start records) used to bring the estimate to $0."""
    import time

    cfg = RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="r1"', "replicas=2",
                                "rounds=3"])
    run = launch(cfg, FakeExecutor(rounds=3, finish=False, usd_per_replica_hour=3.6))
    now = time.time()
    run.status(now=now)
    before = run.status(now=now + 1000).est_usd
    assert before is not None and before >= 2 * 1000 * 3.6 / 3600 - 1e-9  # two replicas polled running
    store, _ = load_run(run.url)
    store.delete("members", recursive=True)  # the co-tenant
    after = run.status(now=now + 1000).est_usd
    assert after is not None and after >= before
