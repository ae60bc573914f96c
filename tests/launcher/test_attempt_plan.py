"""The plan ``diloco launch`` prints when a run will outlast one attempt of its platform (Modal's call
timeout, the HF Job timeout, the local rehearsal cap): read from the executor, computed from the pace."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.executors.local import LocalProcessExecutor
from diloco_serverless.launcher.api import launch
from diloco_serverless.launcher.attempt_plan import AttemptCap, attempt_cap, cap_plan
from support.fake_executor import FakeExecutor


def test_the_cap_comes_from_each_executor_kind() -> None:
    assert attempt_cap(LocalProcessExecutor(attempt_timeout_s=30)) == AttemptCap(30.0, "-x attempt_timeout_s")
    assert attempt_cap(LocalProcessExecutor()) is None  # no rehearsal cap: none
    assert attempt_cap(SimpleNamespace(kind="somecloud", attempt_cap_s=5)) is None  # no setting known for it
    assert attempt_cap(SimpleNamespace(kind="modal")) is None  # an object without attempt_cap_s (a fake)


def test_the_cap_of_the_cloud_executors_is_their_attempt_cap_s(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("modal")
    pytest.importorskip("huggingface_hub")
    from diloco_serverless.executors.hf_jobs import HFJobsExecutor
    from diloco_serverless.executors.modal import ModalExecutor

    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")  # building the executor sends nothing to Modal
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")
    modal = ModalExecutor(timeout_s=86400)
    assert modal.attempt_cap_s == 86400.0
    assert attempt_cap(modal) == AttemptCap(86400.0, "Modal's function timeout (-x timeout_s=S, <= 24 h)")
    hf = HFJobsExecutor(timeout="2h", token="hf-fake", forward_credentials=False)
    assert hf.attempt_cap_s == 7200.0
    assert attempt_cap(hf) == AttemptCap(7200.0, "the HF Job timeout (-x timeout=...)")
    unset = HFJobsExecutor(timeout=None, token="hf-fake", forward_credentials=False)
    assert unset.attempt_cap_s is None and attempt_cap(unset) is None  # the Hub's default applies


def test_a_run_that_fits_one_attempt_gets_no_plan() -> None:
    cap = AttemptCap(86400.0, "Modal's function timeout")
    # 10 rounds in 1 h: 1000 rounds take 100 h (5 attempts); 20 rounds take 2 h (fits)
    assert cap_plan(cap, "modal", rounds_total=20, rounds_done=10, elapsed_s=3600) is None
    assert cap_plan(cap, "modal", rounds_total=1000, rounds_done=0, elapsed_s=60) is None  # no pace yet
    assert cap_plan(None, "modal", rounds_total=1000, rounds_done=10, elapsed_s=3600) is None


@pytest.mark.parametrize(("kind", "who"), [("modal", "spawns the next one itself"),
                                            ("hf-jobs", "diloco resume RUN_URL")])
def test_a_72h_run_gets_the_number_of_attempts_and_who_starts_them(kind: str, who: str) -> None:
    plan = cap_plan(AttemptCap(86400.0, "the cap"), kind, rounds_total=720, rounds_done=10, elapsed_s=3600)
    assert plan is not None
    assert "72.0 h" in plan and "about 3 attempts" in plan and who in plan and "not retries" in plan


def test_launch_returns_preflight_warnings_as_notes_and_no_plan_without_a_cap(tmp_path: Path) -> None:
    cfg = RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", "run_id=\"p1\"", "replicas=2"])
    run = launch(cfg, executor=FakeExecutor(finish=False))
    assert run.notes == []  # a local store and a fake executor: nothing to warn about
    assert run.attempt_plan(run.status(with_metrics=False)) is None  # the fake executor has no cap
