"""A reward module that is only a file on the launching machine reaches remote replicas, clean room.

``diloco launch`` from a project folder holding ``clean_rewards_*.py``: the GRPO run's replicas import the
reward function from what the launcher sent, not from the test machine's path (the folder is on no
path the remote side sees). Modal: the real SDK uploads the module as an image mount to the fake
Modal server, whose container starts in a folder holding only what was mounted (its ``/root``); HF
Jobs: the module travels in the shipped wheel, installed in a fresh venv that has neither the package
nor the module. Each runs the real replica entrypoint for one GRPO round over moto S3; the reward
module prints where it was imported from, and its constant reward is the round's ``reward_mean``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.executors.base import ReplicaHandle
from diloco_serverless.launcher.api import launch
from support import pythonpath_env

pytestmark = pytest.mark.slow

REWARD_MODULE = '''"""A user's reward module: a file in the launching folder only."""
print(f"[{__name__}] imported from {__file__}", flush=True)


def quarter(prompts, completions, **columns):
    assert len(columns["answer"]) == len(completions)
    return [0.25 for _ in completions]
'''


def _project(tmp_path: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's project folder (the launch's working directory): the reward module and the prompts."""
    project = tmp_path / "project"
    project.mkdir()
    (project / f"{module}.py").write_text(REWARD_MODULE)
    rows = [{"prompt": f"say {c} {i}", "answer": c} for i, c in enumerate("abcdefghijkl")]
    (project / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(project)
    return project


def _config(store: str, run_id: str, project: Path, module: str) -> RunConfig:
    return RunConfig.load(None, [
        f"store={json.dumps(store)}", f"run_id={json.dumps(run_id)}", "replicas=1", "rounds=1",
        "inner.sync_every=1", "checkpoint_every=0", "eval_every=0", "data.eval_batches=1",
        'data.format="prompt"', f"data.source={json.dumps(str(project / 'prompts.jsonl'))}", "data.batch_size=2",
        "data.seq_len=32", 'loss.channel1="grpo"', "loss.alpha_sdpo=0.0", "loss.beta_replay=0.0",
        f'rl.reward_funcs=["{module}:quarter"]', "rl.num_generations=2", "rl.max_completion_length=4",
    ])  # fmt: skip


def _imported_from(log: str, module: str) -> Path:
    found = re.findall(rf"\[{module}\] imported from (\S+)", log)
    assert found, log[-4000:]
    return Path(found[0])


def _check_round(run: object, status: object) -> None:
    """The round's metrics carry the module's constant reward, and so do the replica's heartbeat and
    ``diloco status`` (read back from the store)."""
    from diloco_serverless.cli.render import rl_line

    (records,) = run.metrics().values()  # type: ignore[attr-defined]
    (record,) = records
    assert record["reward_mean"] == pytest.approx(0.25) and record["reward/quarter/mean"] == pytest.approx(0.25)
    rl = status.rl  # type: ignore[attr-defined]
    assert rl is not None and rl["reward_mean"] == pytest.approx(0.25) and rl["reward/quarter/mean"] == 0.25
    assert rl["completion_length"] == pytest.approx(record["completion_length"])
    assert (rl_line(status) or "").startswith("RL: reward 0.250 ± 0.000 | completion ")  # type: ignore[arg-type]


def test_modal_replicas_import_the_reward_module_from_the_image_mount(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_store_url: str, s3_env: dict[str, str]
) -> None:
    pytest.importorskip("modal")
    from diloco_serverless.executors.modal import ModalExecutor
    from support.modal_grpc_server import fake_modal

    module = "clean_rewards_modal"
    project = _project(tmp_path, module, monkeypatch)
    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    container_env = {**s3_env, "PYTHONPATH": pythonpath_env()}
    assert str(project) not in container_env["PYTHONPATH"]
    with fake_modal(monkeypatch, execute=True, mounts=True, container_env=container_env) as srv:
        ex = ModalExecutor(gpu=None, secrets=["diloco-s3"], retries=0, timeout_s=900, show_output=False,
                           poll_interval_s=0.3)
        run = launch(_config(f"{s3_store_url}/runs", "modal-rewards", project, module), executor=ex)
        status = run.wait(poll_interval_s=0.5, timeout_s=600)
        (call,) = srv.calls.values()
        log = "\n".join(call.logs)
        assert status.state == "succeeded", log[-4000:]
        where = _imported_from(log, module)
        # the container imported the copy it was sent (laid out under its /root), not the project's file
        assert where.name == f"{module}.py" and where.parent.name == "root" and project not in where.parents
        assert where.read_text() == REWARD_MODULE
        mounted = {f for files in srv.mount_files.values() for f, _, _ in files}
        assert f"/root/{module}.py" in mounted and "/root/diloco_serverless/__init__.py" in mounted
    _check_round(run, status)


def test_hf_jobs_install_the_reward_module_with_the_shipped_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_store_url: str, s3_env: dict[str, str]
) -> None:
    pytest.importorskip("huggingface_hub")
    pytest.importorskip("s3fs")
    from diloco_serverless.executors.hf_jobs import HFJobsExecutor
    from support.fake_hf_jobs_server import CleanRoom, FakeHFJobsServer

    module = "clean_rewards_hf"
    project = _project(tmp_path, module, monkeypatch)
    for k, v in s3_env.items():
        monkeypatch.setenv(k, v)
    room = CleanRoom()
    try:
        with FakeHFJobsServer(clean_room=room, log_stream_close_s=0.5) as hub:
            ex = HFJobsExecutor(flavor="cpu-basic", image="python:3.11", endpoint=hub.url, token=hub.token,
                                retries=0, poll_interval_s=0.5)
            run = launch(_config(f"{s3_store_url}/runs", "hf-rewards", project, module), executor=ex)
            status = run.wait(poll_interval_s=0.5, timeout_s=600)
            (handle,) = run.handles
            log = ex.logs(ReplicaHandle.from_json(handle), tail=None)
            assert status.state == "succeeded", log[-4000:]
        where = _imported_from(log, module)
        # installed from the wheel into the Job's fresh venv
        assert "site-packages" in where.parts and room.root in where.parents and project not in where.parents
        assert ex.shipped_code is not None and ex.user_modules[0].name == module
    finally:
        room.close()
    _check_round(run, status)

