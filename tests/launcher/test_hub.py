"""Pushing a finished run to the Hub (launcher/hub.py, Run.push_to_hub) against a fake of ``HfApi`` at its
method boundary (create_repo, upload_folder): what is uploaded, the model card, who supplies the token,
and the runs that are refused. Nothing talks to the real Hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import RUN_KEY_ENV, RunConfig
from diloco_serverless.errors import ConfigError, LaunchError
from diloco_serverless.launcher import hub
from diloco_serverless.launcher.api import Run, launch
from diloco_serverless.run.members import write_metrics
from diloco_serverless.run.record import load_run
from support.fake_executor import FakeExecutor, write_final

huggingface_hub = pytest.importorskip("huggingface_hub")  # the `hf` extra
hf_constants = pytest.importorskip("huggingface_hub.constants")

TOKEN = "hf_" + "T" * 34  # shape of a Hub token; lives only in this process's environment


class FakeHfApi:
    """``HfApi`` at its method boundary: records the calls and keeps a copy of what was uploaded."""

    instances: list[FakeHfApi] = []

    def __init__(self, token: str | None = None, fail: Exception | None = None) -> None:
        self.token = token
        self.fail = fail
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.uploaded: dict[str, bytes] = {}
        FakeHfApi.instances.append(self)

    def create_repo(self, **kwargs: Any) -> huggingface_hub.RepoUrl:
        self.calls.append(("create_repo", kwargs))
        if self.fail is not None:
            raise self.fail
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{kwargs['repo_id']}")

    def upload_folder(self, **kwargs: Any) -> str:
        self.calls.append(("upload_folder", kwargs))
        root = Path(kwargs["folder_path"])
        self.uploaded = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return "commit"

    @property
    def card(self) -> str:
        return self.uploaded["README.md"].decode()


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> type[FakeHfApi]:
    """The fake in place of huggingface_hub.HfApi; HF_TOKEN set; no login file of this machine is read."""
    FakeHfApi.instances = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return FakeHfApi


class FinishedExecutor(FakeExecutor):
    """FakeExecutor whose run also leaves what write_final leaves: tokens in the metrics, a tokenizer,
    LOCK.json and DONE.json."""

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        handles = super().launch_replicas(n_replicas, entrypoint, entrypoint_args, env)
        store, _ = load_run((env or {})["DILOCO_RUN_URL"])
        for rank in range(n_replicas):
            for rnd in range(self.rounds):
                rec: dict[str, Any] = {"loss": 5.0 - 0.5 * rnd, "lm_ce": 4.0 - 0.5 * rnd, "tokens": 1000}
                if rank == 0:
                    rec["eval_loss"] = 4.2 - 0.5 * rnd
                write_metrics(store, rank, rnd, rec)
        if self.finish and not self.fail_ranks:
            store.put("final/LOCK.json", b'{"rank": 0}')
            write_final(store, {"final/model.safetensors": b"not really a model", "final/config.json": b"{}",
                                "final/tokenizer.json": b"{}"}, (env or {}).get(RUN_KEY_ENV))
        return handles


def _launched(tmp_path: Path, *sets: str, finish: bool = True, fail_ranks: tuple[int, ...] = ()) -> Run:
    cfg = RunConfig.load(None, [f"store={json.dumps(str(tmp_path / 'runs'))}", 'run_id="r1"', "replicas=2", "rounds=3",
                                *sets])
    return launch(cfg, FinishedExecutor(rounds=3, finish=finish, fail_ranks=fail_ranks))


# ------------------------------------------------------------------------------------ a run that succeeded
def test_push_uploads_final_with_a_model_card_and_the_loss_plot(tmp_path: Path, hf: type[FakeHfApi]) -> None:
    run = _launched(tmp_path, 'hub.repo_id="my-org/tiny-diloco"')
    assert run.wait(poll_interval_s=0.01).state == "succeeded"
    url = run.push_to_hub()
    assert url == "https://huggingface.co/my-org/tiny-diloco"
    (api,) = hf.instances
    assert api.token == TOKEN  # from HF_TOKEN on this machine
    assert [name for name, _ in api.calls] == ["create_repo", "upload_folder"]
    assert api.calls[0][1] == {"repo_id": "my-org/tiny-diloco", "repo_type": "model", "private": True, "exist_ok": True}
    assert api.calls[1][1]["repo_id"] == "my-org/tiny-diloco"
    assert "r1" in api.calls[1][1]["commit_message"]
    # final/'s model files, never the run's bookkeeping; the card and the plot beside them
    assert sorted(api.uploaded) == ["README.md", "config.json", "loss.png", "model.safetensors", "tokenizer.json"]
    assert api.uploaded["model.safetensors"] == b"not really a model"
    assert api.uploaded["loss.png"].startswith(b"\x89PNG\r\n\x1a\n")
    card = api.card
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "![Training loss per replica and eval loss per round](loss.png)" in card
    assert "| base model | `tiny` (a ~1M-parameter Qwen2" in card
    assert "| data | `stdlib`" in card
    assert "| rounds | 3/3 (H = 16 inner steps each) |" in card
    assert "| tokens trained | 6,000 |" in card  # 2 replicas x 3 rounds x 1000
    assert "| bytes moved through the store | 14.6 KiB |" in card  # heartbeats: 2 x 3 x (1000 + 1500)
    assert "| final eval loss | 3.2000 |" in card
    assert "| replicas | 2 (local) |" in card
    config = json.loads(card.split("```json\n", 1)[1].split("\n```", 1)[0])
    expected = run.config.to_json_dict()
    del expected["store"]  # where the bucket is stays out of the card
    assert config == expected
    assert TOKEN not in card and "HF_TOKEN" not in json.dumps(config)


def test_push_names_base_model_and_dataset_in_the_card_metadata(tmp_path: Path, hf: type[FakeHfApi]) -> None:
    run = _launched(tmp_path, 'model.name="HuggingFaceTB/SmolLM2-135M"', 'model.revision="main"',
                    'data.source="hf:HuggingFaceFW/fineweb-edu"', 'data.config="sample-10BT"', 'data.format="text"',
                    "loss.alpha_sdpo=0", "loss.beta_replay=0")
    run.wait(poll_interval_s=0.01)
    run.push_to_hub("my-org/smollm2-diloco", private=False)
    (api,) = hf.instances
    assert api.calls[0][1]["private"] is False
    head = api.card.split("\n---\n", 1)[0]
    assert 'base_model: "HuggingFaceTB/SmolLM2-135M"' in head
    assert 'datasets:\n- "HuggingFaceFW/fineweb-edu"' in head
    assert "[`HuggingFaceTB/SmolLM2-135M`](https://huggingface.co/HuggingFaceTB/SmolLM2-135M) @ `main`" in api.card
    assert ("[`HuggingFaceFW/fineweb-edu`](https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu) "
            "(format `text`, config `sample-10BT`, split `train`)") in api.card
    assert 'from_pretrained("my-org/smollm2-diloco")' in api.card


def test_a_local_model_folder_is_not_claimed_as_a_hub_base_model(tmp_path: Path) -> None:
    folder = tmp_path / "my" / "model"
    folder.mkdir(parents=True)
    cfg = RunConfig.load(None, [f"model.name={json.dumps(str(folder))}"])
    assert hub.base_model_id(cfg) is None
    assert hub.base_model_id(RunConfig.load(None, ['model.name="Qwen/Qwen2.5-0.5B"'])) == "Qwen/Qwen2.5-0.5B"
    assert hub.base_model_id(RunConfig()) is None  # tiny


# ------------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("finish,fail_ranks,state", [(False, (), "running"), (True, (1,), "failed")])
def test_a_run_that_did_not_succeed_is_refused(tmp_path: Path, hf: type[FakeHfApi], finish: bool,
                                               fail_ranks: tuple[int, ...], state: str) -> None:
    run = _launched(tmp_path, finish=finish, fail_ranks=fail_ranks)
    with pytest.raises(LaunchError, match=f"run r1 is {state}, not succeeded.*refusing to push it"):
        run.push_to_hub("my-org/x")
    assert all(api.calls == [] for api in hf.instances)


def test_a_run_without_a_complete_final_model_is_refused(tmp_path: Path, hf: type[FakeHfApi]) -> None:
    run = _launched(tmp_path)
    run.wait(poll_interval_s=0.01)
    Path(run.url.removeprefix("file://"), "final", "DONE.json").unlink()
    with pytest.raises(LaunchError, match=r"no complete final model \(.*final/DONE.json is missing\)"):
        run.push_to_hub("my-org/x")
    assert all(api.calls == [] for api in hf.instances)


def test_no_token_on_this_machine_is_refused_before_any_hub_call(tmp_path: Path, hf: type[FakeHfApi],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run = _launched(tmp_path)
    run.wait(poll_interval_s=0.01)
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(LaunchError, match="needs a Hugging Face token with write access: run `hf auth login` or "
                                          "export HF_TOKEN"):
        run.push_to_hub("my-org/x")
    assert hf.instances == []
    # the `hf auth login` file counts as a token
    token_file = Path(hf_constants.HF_TOKEN_PATH)
    token_file.parent.mkdir(parents=True)
    token_file.write_text(TOKEN)
    run.push_to_hub("my-org/x")
    assert hf.instances[0].token == TOKEN


def test_no_repository_and_a_bad_repository_are_refused(tmp_path: Path, hf: type[FakeHfApi]) -> None:
    run = _launched(tmp_path)
    run.wait(poll_interval_s=0.01)
    with pytest.raises(LaunchError, match="no Hub repository for run r1: name one"):
        run.push_to_hub()
    with pytest.raises(ConfigError, match='must be a Hub model repository "ORG/NAME"'):
        run.push_to_hub("not-a-repo-id")
    assert hf.instances == []


def test_a_hub_error_says_the_run_is_fine_and_how_to_retry(tmp_path: Path, hf: type[FakeHfApi]) -> None:
    run = _launched(tmp_path)
    run.wait(poll_interval_s=0.01)
    api = FakeHfApi(fail=PermissionError("403 Forbidden: you cannot write to my-org"))
    with pytest.raises(LaunchError, match=r"pushing run r1 to my-org/x failed: 403 Forbidden.*the run itself is "
                                          r"fine, retry with: diloco push file://.*/runs/r1 my-org/x"):
        run.push_to_hub("my-org/x", api=api)


def test_keys_that_would_leave_the_upload_folder_are_skipped() -> None:
    assert hub._safe_relative("final/model.safetensors") == hub.PurePosixPath("model.safetensors")
    assert hub._safe_relative("final/sub/tokenizer.json") == hub.PurePosixPath("sub/tokenizer.json")
    assert hub._safe_relative("final/./x") == hub.PurePosixPath("x")
    for key in ("final/../run.json", "final/a/../../run.json", "final//etc/passwd", "final/DONE.json",
                "final/LOCK.json", "final/"):
        assert hub._safe_relative(key) is None, key


def test_the_fake_matches_the_real_hfapi_signatures() -> None:
    """What push_final calls on the fake exists, with those keywords, on the installed ``HfApi``."""
    import inspect

    real = huggingface_hub.HfApi  # the fixture is not active here: the real class
    assert "token" in inspect.signature(real).parameters
    for method, keywords in {"create_repo": ("repo_id", "repo_type", "private", "exist_ok"),
                             "upload_folder": ("repo_id", "repo_type", "folder_path", "commit_message")}.items():
        params = inspect.signature(getattr(real, method)).parameters
        assert set(keywords) <= set(params), (method, keywords)
    assert callable(huggingface_hub.get_token)
