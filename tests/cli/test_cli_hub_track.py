"""``diloco launch --push-to-hub``, ``diloco push`` and ``diloco track`` with the fake executor, a fake
``HfApi`` (create_repo / upload_folder) and TensorBoard event files; nothing reaches the Hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.config import RUN_KEY_ENV
from diloco_serverless.launcher import api, preflight
from diloco_serverless.run.record import load_run
from support.fake_executor import FakeExecutor, write_final

huggingface_hub = pytest.importorskip("huggingface_hub")  # the `hf` extra
hf_constants = pytest.importorskip("huggingface_hub.constants")

runner = CliRunner()
TOKEN = "hf_" + "C" * 34


class DoneExecutor(FakeExecutor):
    """FakeExecutor whose finished run also has final/DONE.json, as write_final leaves it."""

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        handles = super().launch_replicas(n_replicas, entrypoint, entrypoint_args, env)
        if self.finish and not self.fail_ranks:
            store, _ = load_run((env or {})["DILOCO_RUN_URL"])
            write_final(store, {"final/model.safetensors": b"not really a model", "final/config.json": b"{}"},
                        (env or {}).get(RUN_KEY_ENV))
        return handles


class FakeHfApi:
    instances: list[FakeHfApi] = []

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.files: list[str] = []
        FakeHfApi.instances.append(self)

    def create_repo(self, **kwargs: Any) -> huggingface_hub.RepoUrl:
        self.calls.append(("create_repo", kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{kwargs['repo_id']}")

    def upload_folder(self, **kwargs: Any) -> None:
        self.calls.append(("upload_folder", kwargs))
        root = Path(kwargs["folder_path"])
        self.files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[FakeHfApi]:
    FakeHfApi.instances = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return FakeHfApi


def use(monkeypatch: pytest.MonkeyPatch, ex: FakeExecutor) -> FakeExecutor:
    monkeypatch.setattr(preflight, "build_executor", lambda kind, gpu, options: ex)
    monkeypatch.setattr(api, "executor_from_launch", lambda launch, run_url=None: (ex, None))
    return ex


def _launch(*args: str) -> Any:
    return runner.invoke(app, ["launch", "--run-id", "r1", "--set", "rounds=3", "--poll-interval", "0.1", *args])


# ------------------------------------------------------------------------------------ --push-to-hub
def test_launch_push_to_hub_uploads_after_success(workdir: Path, hf: type[FakeHfApi],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, DoneExecutor())
    result = _launch("--push-to-hub", "my-org/tiny-diloco")
    assert result.exit_code == 0, result.output
    assert "run r1 succeeded" in result.stdout
    assert "pushed: https://huggingface.co/my-org/tiny-diloco" in result.stdout
    (hub_api,) = hf.instances
    assert hub_api.token == TOKEN
    assert hub_api.calls[0] == ("create_repo", {"repo_id": "my-org/tiny-diloco", "repo_type": "model",
                                                "private": True, "exist_ok": True})
    assert hub_api.files == ["README.md", "config.json", "loss.png", "model.safetensors"]
    recorded = json.loads((workdir / "runs" / "r1" / "run.json").read_text())
    assert recorded["config"]["hub"] == {"repo_id": "my-org/tiny-diloco", "private": True}
    assert TOKEN not in (workdir / "runs" / "r1" / "run.json").read_text()


def test_launch_push_to_hub_without_a_token_creates_nothing(workdir: Path, hf: type[FakeHfApi],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    ex = use(monkeypatch, DoneExecutor())
    monkeypatch.delenv("HF_TOKEN")
    result = _launch("--push-to-hub", "my-org/x")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --push-to-hub my-org/x needs a Hugging Face token with write access")
    assert len(result.stderr.strip().splitlines()) == 1
    assert ex.launched == [] and not (workdir / "runs").exists() and hf.instances == []


def test_launch_push_to_hub_needs_org_and_name(workdir: Path, hf: type[FakeHfApi],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ex = use(monkeypatch, DoneExecutor())
    result = _launch("--push-to-hub", "just-a-name")
    assert result.exit_code == 2
    assert 'hub.repo_id: must be a Hub model repository "ORG/NAME"' in result.stderr
    assert ex.launched == []


def test_a_failed_run_is_not_pushed(workdir: Path, hf: type[FakeHfApi], monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, DoneExecutor(fail_ranks=(1,)))
    result = _launch("--push-to-hub", "my-org/x")
    assert result.exit_code == 1
    assert "rank 1" in result.stderr
    assert all(h.calls == [] for h in hf.instances)


def test_detached_launch_says_how_to_push_and_track(workdir: Path, hf: type[FakeHfApi],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, DoneExecutor(finish=False))
    result = _launch("--detach", "--push-to-hub", "my-org/x", "--set", "tracking.backends=tensorboard")
    assert result.exit_code == 0, result.output
    url = (workdir / "runs" / "r1").as_uri()
    assert f"push it when it succeeds: diloco push {url} my-org/x" in result.stdout
    assert f"track it (tensorboard) with: diloco track {url} --watch" in result.stdout
    assert hf.instances == []


# ------------------------------------------------------------------------------------ diloco push
def test_push_a_finished_run(workdir: Path, hf: type[FakeHfApi], monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, DoneExecutor())
    assert _launch().exit_code == 0
    result = runner.invoke(app, ["push", "r1", "my-org/later", "--public"])
    assert result.exit_code == 0, result.output
    assert "pushed run r1 to https://huggingface.co/my-org/later" in result.stdout
    assert hf.instances[0].calls[0][1]["private"] is False


def test_push_refuses_a_run_that_did_not_succeed(workdir: Path, hf: type[FakeHfApi],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, DoneExecutor(finish=False))
    assert _launch("--detach").exit_code == 0
    result = runner.invoke(app, ["push", "r1", "my-org/x"])
    assert result.exit_code == 2
    assert "error: run r1 is running, not succeeded: refusing to push it" in result.stderr
    result = runner.invoke(app, ["push", "r1"])
    assert result.exit_code == 2
    assert "no Hub repository for run r1" in result.stderr
    assert hf.instances == []


# ------------------------------------------------------------------------------------ tracking
def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, round(e.value, 4)) for e in events.Scalars(tag)]


def test_attached_launch_tracks_to_tensorboard(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    use(monkeypatch, DoneExecutor())
    result = _launch("--replicas", "2", "--set", "tracking.backends=tensorboard")
    assert result.exit_code == 0, result.output
    assert "tracking: tensorboard (project diloco, run r1)" in result.stdout
    assert _scalars(workdir / "tensorboard" / "r1", "loss/total") == [(0, 4.975), (1, 4.475), (2, 3.975)]


def test_track_a_detached_run(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    use(monkeypatch, DoneExecutor())
    assert _launch("--detach", "--replicas", "2", "--set", "tracking.backends=tensorboard").exit_code == 0
    assert not (workdir / "tensorboard").exists()
    result = runner.invoke(app, ["track", "--watch", "--interval", "0.1"])  # the latest run under ./runs
    assert result.exit_code == 0, result.output
    assert "tracked run r1 (succeeded, round 3/3) to tensorboard" in result.stdout
    assert [s for s, _ in _scalars(workdir / "tensorboard" / "r1", "eval/loss")] == [0, 1, 2]


def test_track_a_run_without_backends_is_one_line_error(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use(monkeypatch, DoneExecutor())
    assert _launch("--detach").exit_code == 0
    result = runner.invoke(app, ["track", "r1"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: run r1 has no tracking.backends")
