"""The three Hub examples of ``examples/`` run end to end on this machine: each example's TOML, loaded
with ``RunConfig.load`` and changed only where it must be local (a tiny model folder written with
``save_pretrained`` in place of the Hub model, a local dataset folder with the Hub dataset's columns in
place of ``hf:...``, TensorBoard in place of trackio, a store, 2 replicas, 3 short rounds), is launched
with the local executor (real replica processes reading the data with 🤗 datasets, offline), followed
by ``Run.wait``; the run succeeds, ``final/`` loads with AutoModelForCausalLM and AutoTokenizer, and
the tracked series read back from TensorBoard's event files have one point per round.

Then exact resume end to end: the text example with a checkpoint every round, one replica SIGKILLed
mid-run and restarted by the local executor's supervisor, ends with final global parameters
bit-identical to the same run without the kill (the checkpoint stores each replica's data position,
inner optimizer and RNG, so the restarted replica reads exactly the records it would have read).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diloco_serverless.config import RunConfig
from diloco_serverless.executors.local import replica_paths
from diloco_serverless.launcher.api import Run, launch
from diloco_serverless.store.objectstore import ObjectStore
from support import REPO_ROOT
from support.examples_e2e import offline_env, save_tiny_model, tensorboard_scalars, write_example_data

pytestmark = pytest.mark.slow

pytest.importorskip("datasets")

ROUNDS = 3
SYNC_EVERY = 2
#: what every example changes to run here: small rounds and batches, the checkpoint and eval paths
#: exercised mid-run, the store polled often; each example's own loss, data format, columns and
#: splits stay as they are.
SMALL = [
    "replicas=2", "min_replicas=none", f"rounds={ROUNDS}", "checkpoint_every=2", "eval_every=2",
    f"inner.sync_every={SYNC_EVERY}", "inner.warmup_steps=2", "data.batch_size=2", "data.eval_batches=2",
    "data.hint_len=16", "data.prefetch=2", "exchange.poll_interval_s=0.1",
]
#: example -> (stand-in data format, its own overrides). The Hub datasets are streamed (``hf:``
#: sources stream by default); so are their local stand-ins here. FineWeb-Edu's and OpenR1-Math's
#: subsets ("sample-10BT", "default") are Hub configurations a local folder does not have.
EXAMPLES: dict[str, tuple[str, list[str]]] = {
    "pretrain_text_fineweb.toml": ("text", ["data.config=none", "data.seq_len=64", "data.eval_fraction=0.1",
                                            "data.shuffle_buffer=32"]),
    "chat_sft_self_distill.toml": ("chat", ["data.config=none", "data.seq_len=96", "data.eval_fraction=0.1"]),
    "preference_simpo.toml": ("preference", ["data.seq_len=64"]),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 + BPE tokenizer with a chat template, a ``save_pretrained`` folder."""
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hub and datasets offline, caches under ``tmp_path``; local replicas inherit this environment."""
    for name, value in offline_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DILOCO_DUMP_PARAMS", raising=False)
    return tmp_path


def local_config(example: str, tmp: Path, model: Path, run_id: str, *extra: str, streaming: bool = True) -> RunConfig:
    """``examples/<example>`` with only what must be local (and small) overridden; the local data is
    streamed like the Hub dataset it stands for, or with ``streaming=False`` prepared (an Arrow copy in
    the datasets cache, what local files get by default)."""
    kind, own = EXAMPLES[example]
    data = write_example_data(tmp / f"data-{kind}", kind)
    path = REPO_ROOT / "examples" / example
    original = RunConfig.load(path)
    assert original.data.source.startswith("hf:") and original.model.name != "tiny"
    assert original.data.format == kind
    cfg = RunConfig.load(path, [
        f"store={json.dumps(str(tmp / 'runs'))}", f"run_id={json.dumps(run_id)}",
        f"model.name={json.dumps(str(model))}", f"data.source={json.dumps(str(data))}",
        f"data.streaming={str(streaming).lower()}",
        'tracking.backends=["tensorboard"]', f"tracking.tensorboard_dir={json.dumps(str(tmp / 'tb'))}",
        *SMALL, *own, *extra,
    ])
    # what the example is about is kept: its format, columns, splits, loss and precision
    assert (cfg.data.format, cfg.data.columns, cfg.data.split, cfg.data.eval_split) == (
        original.data.format, original.data.columns, original.data.split, original.data.eval_split)
    assert cfg.loss == original.loss and cfg.model.precision == original.model.precision
    return cfg


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
                     for p in sorted((run_dir / "logs").glob("rank-*.log")))


def _wait(run: Run, run_dir: Path, timeout_s: float = 240) -> Any:
    try:
        return run.wait(poll_interval_s=0.5, timeout_s=timeout_s)
    except BaseException as exc:
        if run.handles:
            try:
                run.cancel()
            except Exception:
                pass
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{_logs(run_dir)}") from exc


def _load_final(run_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final"
    assert (final / "DONE.json").is_file(), sorted(p.name for p in final.iterdir())
    return AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)


# ------------------------------------------------------------------------------------ the examples
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_runs_end_to_end_locally(example: str, tiny_model: Path, offline: Path) -> None:
    pytest.importorskip("tensorboard")
    kind = EXAMPLES[example][0]
    cfg = local_config(example, offline, tiny_model, run_id=kind)
    run = launch(cfg, executor="local", executor_options={"retries": 0})
    run_dir = offline / "runs" / kind
    status = _wait(run, run_dir)

    # the run succeeded: every replica trained every round with both replicas in its quorum
    assert status.state == "succeeded", _logs(run_dir)
    assert [r.state for r in status.replicas] == ["succeeded", "succeeded"]
    assert status.final_url == f"{run.url}/final"
    metrics = run.metrics()
    for rank in (0, 1):
        records = metrics[rank]
        assert [m["round"] for m in records] == list(range(ROUNDS)), records
        assert all(m["participants"] == [0, 1] and m["committed"] for m in records)
        assert all(math.isfinite(m["total"]) and m["lm_ce"] > 0 and m["tokens"] > 0 for m in records)
        if kind == "chat":  # channel 2: the teacher reads the answer as a hint
            assert all(m["sdpo_jsd"] > 0 for m in records)
        if kind == "preference":  # channel 3: SimPO on chosen / rejected
            assert all(m["trace_replay_dpo"] > 0 for m in records)
    assert status.eval_loss is not None and math.isfinite(status.eval_loss)

    # final/ is a model (and its tokenizer, with the chat template) transformers loads
    model, tokenizer = _load_final(run_dir)
    assert model.config.model_type == "qwen2" and model.dtype == torch.bfloat16  # the example's precision
    assert tokenizer.chat_template and tokenizer.eos_token == "<|endoftext|>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Add 2 and 3."}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(run_dir / "final" / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k].to(torch.bfloat16), after[k]) for k in before), "nothing was trained"

    # the tracked series, read back from TensorBoard's event files: one point per round
    scalars = tensorboard_scalars(offline / "tb" / kind)
    for tag in ("loss/total", "loss/lm_ce", "throughput/tokens", "exchange/bytes_moved", "replicas/participants"):
        assert [step for step, _ in scalars[tag]] == list(range(ROUNDS)), (tag, scalars[tag])
    losses = [value for _, value in scalars["loss/total"]]
    want = [sum(metrics[r][i]["total"] for r in (0, 1)) / 2 for i in range(ROUNDS)]
    assert losses == pytest.approx(want, rel=1e-5)
    assert [v for _, v in scalars["replicas/participants"]] == [2.0] * ROUNDS
    assert scalars["eval/loss"] and all(math.isfinite(v) for _, v in scalars["eval/loss"])
    if kind == "chat":
        assert all(v > 0 for _, v in scalars["loss/sdpo_jsd"])
    if kind == "preference":
        assert all(v > 0 for _, v in scalars["loss/trace_replay_dpo"])


# ------------------------------------------------------------------------------------ exact resume
RESUME_ROUNDS = 5
#: the text example, a checkpoint every round (with each replica's data position, optimizer, RNG);
#: small shuffle windows and rows so that the checkpoints fall mid-window and mid-document
RESUME = [f"rounds={RESUME_ROUNDS}", "checkpoint_every=1", "eval_every=0", "inner.sync_every=4",
          "data.shuffle_buffer=16", "tracking.backends=[]"]
LOADED = re.compile(r"loaded checkpoint of round (\d+) \(step \d+\) with this replica's own state")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _resume_run(tmp: Path, model: Path, run_id: str, monkeypatch: pytest.MonkeyPatch, *,
                kill: bool, streaming: bool) -> tuple[Path, Path, Any]:
    """The text example (see RESUME); with ``kill``, rank 1's replica process is SIGKILLed mid-run and
    its supervisor restarts it. Returns (run folder, folder of each rank's final global parameters as
    the replica entrypoint's --dump-params writes them, final status)."""
    dump = tmp / f"dump-{run_id}"
    monkeypatch.setenv("DILOCO_DUMP_PARAMS", str(dump))  # = --dump-params DIR, read by every replica
    cfg = local_config("pretrain_text_fineweb.toml", tmp, model, run_id, *RESUME, streaming=streaming)
    run = launch(cfg, executor="local", executor_options={"retries": 1 if kill else 0, "restart_delay_s": 0.2})
    run_dir = tmp / "runs" / run_id
    if kill:
        try:
            _kill_mid_run(run_dir, rank=1)
        except BaseException:
            run.cancel()
            raise
    return run_dir, dump, _wait(run, run_dir)


def _kill_mid_run(run_dir: Path, rank: int) -> int:
    """SIGKILL ``rank``'s replica process (not its supervisor) once a checkpoint holds its own state
    and 2 or 3 of the 5 rounds are committed (wherever it is then: training, exchanging, writing a
    checkpoint), so at least one round is left; returns the killed pid."""
    def mid_run() -> bool:
        hb = _json(run_dir / "members" / f"rank-{rank}.json")
        if not hb or hb["state"] in ("done", "failed") or not 2 <= hb["round"] <= RESUME_ROUNDS - 2:
            return False
        return any((run_dir / "checkpoints").glob(f"*/replica/rank-{rank}.safetensors"))

    _wait_for(mid_run, 180, f"rank {rank} to work on a round after its first checkpoint")
    state = _wait_for(lambda: (s := _json(replica_paths(run_dir / "logs", rank)[1])) and s.get("child_pid") and s,
                      10, f"rank {rank}'s replica pid")
    os.kill(int(state["child_pid"]), signal.SIGKILL)
    return int(state["child_pid"])


def _resume_point(state: Any) -> Any:
    """A data state without what resuming does not read: 🤗 datasets' RebatchedArrowExamplesIterable
    resumes from its ``previous_state`` (+ chunks and crop since), and once it has reloaded that into
    the Arrow iterable its own ``examples_iterable`` entry is a stale copy (the Arrow iterable's
    ``load_state_dict`` starts a new dict), so that entry differs after a resume and means nothing."""
    if isinstance(state, dict):
        skip = "examples_iterable" if (state.get("type") == "RebatchedArrowExamplesIterable"
                                       and state.get("previous_state") is not None) else None
        return {k: _resume_point(v) for k, v in state.items() if k != skip}
    return state


def _flat_diff(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, a's value, b's value) of every leaf where two JSON documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _flat_diff(a.get(k), b.get(k), f"{path}.{k}")]
    return [] if a == b else [(path, a, b)]


def _losses(run_dir: Path) -> dict[tuple[int, int], float]:
    """(rank, round) -> training loss of that rank's round; every round had both replicas."""
    store, out = ObjectStore(f"file://{run_dir}"), {}
    for key in store.list("metrics/"):
        m = store.get_json(key)
        assert m["participants"] == [0, 1] and m["committed"], (key, m)
        out[(int(key.split("/")[1].removeprefix("rank-")), int(m["round"]))] = m["total"]
    return out


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "prepared"])
def test_killed_replica_resumes_its_data_stream_exactly(tiny_model: Path, offline: Path,
                                                        monkeypatch: pytest.MonkeyPatch, streaming: bool) -> None:
    ref_dir, ref_dump, ref_status = _resume_run(offline, tiny_model, "uninterrupted", monkeypatch, kill=False,
                                                streaming=streaming)
    assert ref_status.state == "succeeded", _logs(ref_dir)
    kill_dir, kill_dump, kill_status = _resume_run(offline, tiny_model, "killed", monkeypatch, kill=True,
                                                   streaming=streaming)
    assert kill_status.state == "succeeded", _logs(kill_dir)

    # the replica was killed mid-run, restarted by its supervisor, loaded a checkpoint with its own state
    # (data position, optimizer, RNG) and re-trained every round after it itself
    supervisor = _json(replica_paths(kill_dir / "logs", 1)[1]) or {}
    assert supervisor.get("attempt") == 1 and supervisor.get("status") == "succeeded", supervisor
    assert [r["exit_code"] for r in supervisor["restarts"]] == [-signal.SIGKILL]
    log = (kill_dir / "logs" / "rank-1.log").read_text(errors="replace")
    restarted = log.split("attempt 1: starting", 1)[1]
    loaded = LOADED.search(restarted)
    assert loaded, restarted[-3000:]
    store = ObjectStore(f"file://{kill_dir}")
    retrained = sorted(m["round"] for m in (store.get_json(k) for k in store.list("metrics/rank-1/"))
                       if m["attempt"] == 1)
    assert retrained == list(range(int(loaded.group(1)) + 1, RESUME_ROUNDS)) and retrained, (loaded[0], retrained)

    # the same batches: every rank's loss of every round equals the uninterrupted run's, to the bit, and
    # the checkpoints both runs kept record the same data positions (record, and token inside it)
    assert _losses(kill_dir) == _losses(ref_dir)
    kept = sorted(p.name for p in (kill_dir / "checkpoints").glob("0*"))
    assert kept and kept == sorted(p.name for p in (ref_dir / "checkpoints").glob("0*"))
    for name in kept:
        for rank in (0, 1):
            states = [_json(d / "checkpoints" / name / "data" / f"rank-{rank}.json") for d in (ref_dir, kill_dir)]
            assert states[0] and states[1]
            differ = _flat_diff(*(_resume_point(st["state"]) for st in states))
            assert not differ, f"checkpoint {name} rank {rank}: data state differs (uninterrupted, killed): {differ}"
            assert states[0]["state"]["stream"]["records"]["epoch"] == 0  # a position inside the stream

    # the final global parameters are bit-identical: on both ranks, with and without the kill
    for dump in (ref_dump, kill_dump):
        assert sorted(p.name for p in dump.iterdir()) == ["rank-0.safetensors", "rank-1.safetensors"]
    ref = load_file(str(ref_dump / "rank-0.safetensors"))
    for other in (ref_dump / "rank-1.safetensors", kill_dump / "rank-0.safetensors", kill_dump / "rank-1.safetensors"):
        got = load_file(str(other))
        assert got.keys() == ref.keys()
        differ = [k for k in ref if not torch.equal(ref[k], got[k])]
        assert not differ, f"{other}: {len(differ)} tensors differ, e.g. {differ[:3]}: max |diff| " + str(
            max(float((ref[k].double() - got[k].double()).abs().max()) for k in differ))
    # and so is final/, which loads
    ref_final = load_file(str(ref_dir / "final" / "model.safetensors"))
    kill_final = load_file(str(kill_dir / "final" / "model.safetensors"))
    assert ref_final.keys() == kill_final.keys() and all(torch.equal(ref_final[k], kill_final[k]) for k in ref_final)
    _load_final(kill_dir)
