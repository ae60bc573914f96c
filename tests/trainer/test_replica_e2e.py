"""`python -m diloco_serverless.entrypoints.replica` as real processes: bad inputs, SIGKILL + restart,
4 replicas on S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diloco_serverless.store.objectstore import ObjectStore
from support.diloco_harness import create_tiny_run, write_jsonl

pytestmark = pytest.mark.slow


def _spawn(
    run_url: str,
    rank: int | str,
    log: Path,
    *,
    attempt: int = 0,
    dump: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    full = {
        **os.environ,
        "REPLICA_RANK": str(rank),
        "DILOCO_RUN_URL": run_url,
        "DILOCO_ATTEMPT": str(attempt),
        "OMP_NUM_THREADS": "1",
        "DILOCO_LOG_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    if dump is not None:
        full["DILOCO_DUMP_PARAMS"] = str(dump)
    with log.open("ab") as fh:
        return subprocess.Popen(
            [sys.executable, "-m", "diloco_serverless.entrypoints.replica"],
            env=full,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )


def _wait(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return codes


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _assert_dumps_identical(folder: Path, ranks: list[int]) -> dict[str, torch.Tensor]:
    first = load_file(str(folder / f"rank-{ranks[0]}.safetensors"))
    for r in ranks[1:]:
        other = load_file(str(folder / f"rank-{r}.safetensors"))
        assert first.keys() == other.keys()
        for k in first:
            assert torch.equal(first[k], other[k]), f"{k}: rank {r} differs from rank {ranks[0]}"
    return first


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, int, str]]:
    """name -> (run URL, rank, expected text of the one-line error)."""
    tmp = tmp_path_factory.mktemp("bad")
    store = f"file://{tmp}/store"
    data = write_jsonl(tmp / "data.jsonl")
    few = write_jsonl(tmp / "few.jsonl", n=3)
    (tmp / "store/broken").mkdir(parents=True)
    (tmp / "store/broken/run.json").write_text("{not json")
    ok_run = create_tiny_run(store, data, 2, run_id="ok")
    empty_run = create_tiny_run(store, few, 4, run_id="empty")
    shape_run = create_tiny_run(store, data, 2, run_id="shape")
    save_file({"model.embed_tokens.weight": torch.zeros(7, 3)}, str(tmp / "bad.safetensors"))
    ObjectStore(shape_run).put("checkpoints/initial.safetensors", (tmp / "bad.safetensors").read_bytes())
    return {
        "broken": (f"{store}/broken", 0, "not valid JSON"),
        "missing": (f"{store}/nope", 0, "no run at"),
        "rank": (ok_run, 5, "rank 5 is outside run ok"),
        "empty": (empty_run, 3, "gets no training data"),
        "shape": (shape_run, 0, "holds other parameters than the model"),
    }


@pytest.mark.parametrize("case", ["broken", "missing", "rank", "empty", "shape"])
def test_bad_inputs_fail_before_training_with_one_line(
    bad_runs, case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco_serverless.entrypoints.replica import main

    url, rank, expect = bad_runs[case]
    monkeypatch.setenv("REPLICA_RANK", str(rank))
    monkeypatch.setenv("DILOCO_LOG_LEVEL", "WARNING")
    assert main(["--run-url", url]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err and err[-1].startswith("error: ") and expect in err[-1], err
    assert not any("Traceback" in ln for ln in err)
    if case == "rank":
        assert not ObjectStore(url).exists("rounds/00000000/quorum.json"), "nothing was trained"


def test_bad_input_exit_code_as_a_process(bad_runs, tmp_path: Path) -> None:
    url, rank, expect = bad_runs["empty"]
    log = tmp_path / "empty.log"
    assert _wait([_spawn(url, rank, log)], 120) == [2]
    assert _last_line(log).startswith("error: ") and expect in _last_line(log)


def test_sigkill_and_restart_rejoins_bit_identical(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 2, rounds=5, checkpoint_every=2, eval_every=0)
    dump = tmp_path / "dump"
    logs = [tmp_path / "rank-0.log", tmp_path / "rank-1.log"]
    procs = [_spawn(url, r, logs[r], dump=dump) for r in range(2)]
    victim_marker = Path(url.removeprefix("file://")) / "metrics/rank-1/00000002.json"
    deadline = time.monotonic() + 180
    while not victim_marker.exists():
        assert time.monotonic() < deadline, logs[1].read_text()
        assert procs[1].poll() is None, f"rank 1 ended early\n{logs[1].read_text()}"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    assert procs[1].wait(timeout=30) == -signal.SIGKILL
    restarted = _spawn(url, 1, logs[1], attempt=1, dump=dump)
    codes = _wait([procs[0], restarted], 240)
    assert codes == [0, 0], f"{logs[0].read_text()}\n---\n{logs[1].read_text()}"
    _assert_dumps_identical(dump, [0, 1])
    store = ObjectStore(url)
    hb = store.get_json("members/rank-1.json")
    assert hb["attempt"] == 1 and hb["state"] == "done" and hb["round"] == 5
    after = sorted(m["round"] for m in (store.get_json(k) for k in store.list("metrics/rank-1/")) if m["attempt"] == 1)
    # it restores its own state from the checkpoint of round 1 and re-trains from round 2 (exact resume)
    assert after == [2, 3, 4], f"the restarted replica rejoined at round {after}"
    assert store.exists("final/DONE.json")


def test_four_replicas_over_s3_produce_loadable_final(
    tmp_path: Path, s3_store_url: str, s3_env: dict[str, str], s3_storage_options: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    for k, v in s3_env.items():  # for this test only: later tests in this worker must not see moto's endpoint
        if k not in os.environ:
            monkeypatch.setenv(k, v)
    url = create_tiny_run(s3_store_url, data, 4, rounds=2, checkpoint_every=1, eval_every=1)
    dump = tmp_path / "dump"
    logs = [tmp_path / f"rank-{r}.log" for r in range(4)]
    procs = [_spawn(url, r, logs[r], dump=dump, env=s3_env) for r in range(4)]
    codes = _wait(procs, 300)
    assert codes == [0, 0, 0, 0], "\n---\n".join(log.read_text()[-3000:] for log in logs)
    params = _assert_dumps_identical(dump, [0, 1, 2, 3])
    store = ObjectStore(url, s3_storage_options)
    done = store.get_json("final/DONE.json")
    assert "final/model.safetensors" in done["files"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from diloco_serverless.trainer.model import download_pretrained

    local = download_pretrained(store, "final", tmp_path / "final")
    model = AutoModelForCausalLM.from_pretrained(local)
    tokenizer = AutoTokenizer.from_pretrained(local)
    loaded = dict(model.named_parameters())
    for k, v in params.items():
        assert torch.equal(loaded[k].detach(), v), k
    assert tokenizer("def f(x):")["input_ids"]
    metrics = [json.loads(store.get(k)) for k in store.list("metrics/")]
    assert len(metrics) == 4 * 2 and all(m["participants"] == [0, 1, 2, 3] for m in metrics)
