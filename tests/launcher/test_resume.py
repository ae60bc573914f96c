"""``resume`` / ``Run.resume`` with in-process executors: what is refused (a finished run, a machine
without the run key, an executor that cannot start some ranks, nothing to resume), the launch record
after a resume, and ``Run.wait`` starting a fresh attempt for a rank in state ``continue``.
The real local run that is cancelled and resumed to the end is in tests/cli/test_cli_resume.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import RUN_KEY_ENV, RunConfig
from diloco_serverless.errors import LaunchError
from diloco_serverless.launcher.api import Run, launch, resume
from diloco_serverless.run.integrity import local_key_path
from diloco_serverless.run.layout import FINAL_PREFIX
from diloco_serverless.run.record import load_run
from support.fake_executor import FakeExecutor, write_final


def _cfg(tmp_path: Path, run_id: str = "r1") -> RunConfig:
    return RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", f"run_id=\"{run_id}\"",
                                 "replicas=2", "rounds=2"])


class RankedFake(FakeExecutor):
    """Starts any subset of ranks; ``script[(rank, launch)]`` is the state poll reports for that launch."""

    def __init__(self, script: dict[tuple[int, int], str], **kwargs: Any) -> None:
        super().__init__(finish=False, **kwargs)
        self.script = script
        self.ranks_started: list[list[int]] = []

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None, *, ranks: list[int] | None = None) -> list[dict[str, Any]]:
        chosen = list(range(n_replicas)) if ranks is None else list(ranks)
        self.ranks_started.append(chosen)
        self.launched.append({"env": dict(env or {}), "ranks": chosen})
        n = len(self.ranks_started) - 1
        if n > 0:  # the resumed replicas finish the run
            store, _ = load_run(env["DILOCO_RUN_URL"]) if env else (None, None)
            assert store is not None
            write_final(store, {f"{FINAL_PREFIX}/config.json": b"{}"}, (env or {}).get(RUN_KEY_ENV))
        return [{"kind": self.kind, "rank": r, "job": f"fake-{r}-{n}"} for r in chosen]

    def poll(self, handles: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for h in handles:
            launch_no = int(str(h["job"]).rsplit("-", 1)[1])
            out.append({"rank": h["rank"], "state": self.script.get((h["rank"], launch_no), "succeeded")})
        return out


def test_wait_starts_a_fresh_attempt_for_a_rank_to_continue(tmp_path: Path) -> None:
    ex = RankedFake({(1, 0): "continue"})  # rank 0 succeeds; rank 1 stops at its time cap
    run = launch(_cfg(tmp_path), executor=ex)
    final = run.wait(poll_interval_s=0.01)
    assert final.state == "succeeded" and not final.failures  # a continue is not a failure
    assert ex.ranks_started == [[0, 1], [1]]
    assert not ex.cancelled
    launch_record = run.record.launch or {}
    assert launch_record["resumed"] == [1]
    assert [h["job"] for h in run.handles] == ["fake-0-0", "fake-1-1"]  # status and cancel use the newest
    assert [e["handle"]["job"] for e in launch_record["attempts"]["1"]] == ["fake-1-0", "fake-1-1"]
    ids = [launched["env"]["DILOCO_LAUNCH_ID"] for launched in ex.launched]
    assert ids[0] != ids[1] and launch_record["launch_id"] == ids[1]
    # the stored record verifies with the key this machine kept: another process sees the same
    again = Run.attach(run.url, executor=ex)
    assert again.verified and [h["job"] for h in again.handles] == ["fake-0-0", "fake-1-1"]


def test_resume_restarts_only_the_ranks_that_are_not_running(tmp_path: Path) -> None:
    ex = RankedFake({(0, 0): "running", (1, 0): "failed"})
    run = launch(_cfg(tmp_path), executor=ex)
    assert run.resume() == [1]
    assert ex.ranks_started == [[0, 1], [1]]
    with pytest.raises(LaunchError, match="already succeeded"):  # rank 1's resumed replica wrote final/
        run.resume()


def test_resume_of_a_finished_run_is_refused(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), executor=FakeExecutor(rounds=2))
    assert run.wait(poll_interval_s=0.01).state == "succeeded"
    with pytest.raises(LaunchError, match=r"already succeeded \(final model: .*/final\).*diloco launch"):
        resume(run.url, executor=FakeExecutor())


def test_resume_needs_the_run_key_and_says_where_it_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = launch(_cfg(tmp_path), executor=RankedFake({(0, 0): "cancelled", (1, 0): "cancelled"}))
    kept = local_key_path(run.url)
    assert kept.is_file()
    monkeypatch.setenv("DILOCO_KEYS_DIR", str(tmp_path / "another-machine"))
    with pytest.raises(LaunchError) as info:
        resume(run.url, executor=FakeExecutor())
    message = str(info.value)
    assert "does not hold its run key" in message and kept.name in message and "DILOCO_RUN_KEY" in message
    assert str(local_key_path(run.url)) in message  # where to copy it to on this machine


def test_an_executor_without_ranks_gets_a_clear_error(tmp_path: Path) -> None:
    ex = FakeExecutor(finish=False)
    run = launch(_cfg(tmp_path), executor=ex)
    ex.cancel(run.handles)  # the fake now reports both ranks cancelled
    with pytest.raises(LaunchError, match="no 'ranks' keyword.*ranks: Sequence\\[int\\] \\| None = None"):
        run.resume()
    assert len(ex.launched) == 1  # nothing else started


def test_nothing_to_resume_names_the_states(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), executor=RankedFake({(0, 0): "running", (1, 0): "pending"}))
    with pytest.raises(LaunchError, match="nothing to resume.*rank 0 .*rank 1 pending.*diloco cancel"):
        run.resume()
    with pytest.raises(LaunchError, match="--rank 5 is not a rank"):
        run.resume(ranks=[5])


def test_another_executor_kind_is_refused_while_ranks_live_on_the_first(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), executor=RankedFake({(0, 0): "running", (1, 0): "failed"}))
    other = RankedFake({}, kind="fakecloud")
    # rank 0 is running on the platform but has not reported yet: starting, alive all the same
    with pytest.raises(LaunchError, match=r"rank\(s\) \[0\] .* still alive \(rank 0 starting\) on the local"):
        run.resume(other)
    assert other.ranks_started == []


def test_launching_into_an_existing_run_points_at_resume(tmp_path: Path) -> None:
    run = launch(_cfg(tmp_path), executor=FakeExecutor(finish=False))
    with pytest.raises(LaunchError, match=f"diloco resume {run.url}`.*--overwrite"):
        launch(_cfg(tmp_path), executor=FakeExecutor())
