"""The replica loop in-process (replicas in threads, file:// store): metrics, checkpoints, healing, final/."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from diloco_serverless.run.members import read_members, read_metrics
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.diloco import CheckpointMismatch
from diloco_serverless.trainer.loop import ReplicaTrainer, TrainResult
from support.crash_harness import run_two_with_crash
from support.diloco_harness import create_tiny_run, write_jsonl


def _train(run_url: str, ranks: list[int]) -> dict[int, tuple[TrainResult, ReplicaTrainer]]:
    out: dict[int, tuple[TrainResult, ReplicaTrainer]] = {}
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            trainer = ReplicaTrainer.from_run(run_url, rank)
            out[rank] = (trainer.run(), trainer)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return out


def _globals(trainer: ReplicaTrainer) -> dict[str, torch.Tensor]:
    return trainer.rep.global_named_parameters()


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[TrainResult, ReplicaTrainer]]]:
    """Two replicas, 3 outer rounds of H=2, checkpoint every 2 rounds (and at the end), eval every 2."""
    tmp = tmp_path_factory.mktemp("train")
    data = write_jsonl(tmp / "data.jsonl")
    url = create_tiny_run(f"file://{tmp}/store", data, 2, rounds=3, checkpoint_every=2, eval_every=2)
    return url, _train(url, [0, 1])


def test_replicas_end_identical_and_write_final(finished_run, tmp_path: Path) -> None:
    url, results = finished_run
    (r0, t0), (r1, t1) = results[0], results[1]
    _assert_equal(_globals(t0), _globals(t1))
    assert r0.rounds == r1.rounds == 3 and r0.trained_rounds == 3
    assert r0.final_written != r1.final_written, "exactly one replica writes final/"
    store = ObjectStore(url)
    assert ckpt.final_exists(store)
    from transformers import AutoModelForCausalLM

    from diloco_serverless.trainer.model import download_pretrained

    local = download_pretrained(store, "final", tmp_path / "final")
    loaded = AutoModelForCausalLM.from_pretrained(local)
    params = dict(loaded.named_parameters())
    for name, tensor in _globals(t0).items():
        assert torch.equal(params[name].detach(), tensor), name


def test_metrics_heartbeats_and_checkpoints(finished_run) -> None:
    url, _ = finished_run
    store = ObjectStore(url)
    metrics = read_metrics(store)
    assert sorted((m["rank"], m["round"]) for m in metrics) == [(r, k) for r in range(2) for k in range(3)]
    for m in metrics:
        for key in ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo", "tokens_per_s", "inner_s", "wait_s",
                    "bytes_up", "bytes_down", "participants"):
            assert key in m, key
        assert m["committed"] and m["participants"] == [0, 1] and m["bytes_up"] > 0 and m["tokens"] > 0
        assert isinstance(m["data_wait_s"], float) and 0.0 <= m["data_wait_s"] <= m["wall_s"]
        assert m["data_bad_rows"] == 0, "unusable data rows skipped (data.max_bad_fraction)"
        assert m["sdpo_jsd"] > 0 and m["trace_replay_dpo"] > 0, "all three loss channels are live"
    evals = [m["round"] for m in metrics if "eval_loss" in m]
    assert evals == [1, 2], "rank 0 evaluates every eval_every=2 outer rounds and at the end"
    members = read_members(store)
    assert {r: hb.state for r, hb in members.items()} == {0: "done", 1: "done"}
    assert ckpt.find_latest_checkpoint(store) == 2
    assert store.get_json("checkpoints/latest.json")["round"] == 2
    assert [k for k in store.list("checkpoints/") if k.endswith("manifest.json")] == [
        "checkpoints/00000001/manifest.json", "checkpoints/00000002/manifest.json"], "the two newest are kept"
    tensors, info = ckpt.load_checkpoint(store, 2)
    assert info.step == 3 and any("/original_parameters/" in k for k in tensors)
    assert any("momentum_buffer" in k for k in tensors), "outer optimizer state is checkpointed"
    state = ckpt.read_data_state(store, 2, 1)
    assert state is not None and state["position"] == 3 * 2 * 2


@pytest.mark.parametrize("drop", ["last_checkpoint", "all_checkpoints"])
def test_late_replica_heals_bit_identical(finished_run, tmp_path: Path, drop: str) -> None:
    """A fresh replica heals from the newest checkpoint (or none) + replay of stored rounds."""
    url, results = finished_run
    copy = tmp_path / "copy" / "run-test"
    shutil.copytree(url.removeprefix("file://"), copy)
    for own in (copy / "checkpoints").glob("*/replica"):  # fresh: no state of its own (else it would
        shutil.rmtree(own)  # re-train the rounds it took part in, see test_a_crashed_replica_resumes_exactly)
    if drop == "last_checkpoint":  # heal from round 1's checkpoint, replay round 2
        shutil.rmtree(copy / "checkpoints/00000002")
    else:  # replay every round from the initial parameters
        for p in (copy / "checkpoints").glob("0*"):
            shutil.rmtree(p)
    trainer = ReplicaTrainer.from_run(f"file://{copy}", 1)
    # from the run's start (no checkpoint, or none with its own state while every round since the start is
    # stored) a replica of a rank that took part re-trains its rounds exactly (see
    # test_a_crashed_replica_resumes_exactly and test_heal_without_own_state_retrains_from_the_start);
    # here the replay path itself is under test
    trainer.exact_resume = False
    gained = trainer.heal()
    assert gained == 3 and trainer.manager.current_step() == 3
    assert trainer.replayed == (1 if drop == "last_checkpoint" else 3)
    _assert_equal(_globals(trainer), _globals(results[0][1]))
    assert trainer.data.position == 3 * 2 * 2
    trainer.manager.shutdown()


@pytest.mark.parametrize("rounds_kept", [True, False], ids=["rounds_kept", "round_0_pruned"])
def test_heal_without_own_state_retrains_from_the_start(finished_run, tmp_path: Path, rounds_kept: bool) -> None:
    """The newest checkpoint lacks this replica's own state (it was down while another rank took its shard
    over): while every round since the start is stored, a fresh process re-trains from the run's start
    (exact) instead of loading the checkpoint with a fresh inner optimizer; once round 0 is pruned, it
    loads the checkpoint."""
    url, _ = finished_run
    copy = tmp_path / "copy" / "run-test"
    shutil.copytree(url.removeprefix("file://"), copy)
    for own in (copy / "checkpoints").glob("*/replica"):
        shutil.rmtree(own)
    if not rounds_kept:
        shutil.rmtree(copy / "rounds" / "00000000")
    trainer = ReplicaTrainer.from_run(f"file://{copy}", 1)
    start = _globals(trainer)
    gained = trainer.heal()
    if rounds_kept:  # rank 1 took part in round 0: nothing replayed, round 0 is next, to re-train
        assert gained == 0 and trainer.manager.current_step() == 0 and trainer.manager.retrain_own_rounds
        _assert_equal(_globals(trainer), start)
    else:
        assert gained == 3 and trainer.replayed == 0 and not trainer.manager.retrain_own_rounds
    trainer.manager.shutdown()


def test_heal_from_checkpoint_only(finished_run, tmp_path: Path) -> None:
    url, results = finished_run
    copy = tmp_path / "copy" / "run-test"
    shutil.copytree(url.removeprefix("file://"), copy)
    shutil.rmtree(copy / "rounds")
    trainer = ReplicaTrainer.from_run(f"file://{copy}", 0)
    assert trainer.heal() == 3 and trainer.replayed == 0
    _assert_equal(_globals(trainer), _globals(results[1][1]))
    trainer.manager.shutdown()


def test_checkpoint_with_other_shapes_is_refused(finished_run) -> None:
    url, results = finished_run
    trainer = results[0][1]
    tensors, meta = trainer.rep.state_tensors()
    key = next(k for k in tensors if k.endswith("/original_parameters/model__embed_tokens__weight"))
    bad = dict(tensors, **{key: torch.zeros(3, 5)})
    with pytest.raises(CheckpointMismatch, match=r"model\.embed_tokens\.weight.*shape \(3, 5\)"):
        trainer.rep.check_compatible(bad, meta, source="ckpt")
    with pytest.raises(CheckpointMismatch, match="fragments"):
        trainer.rep.check_compatible(tensors, dict(meta, fragments=2), source="ckpt")


def test_rank_outside_run_is_refused(finished_run) -> None:
    url, _ = finished_run
    with pytest.raises(ValueError, match="rank 2 is outside run"):
        ReplicaTrainer.from_run(url, 2)


def test_two_fragments_with_delay_and_int8(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(
        f"file://{tmp_path}/store",
        data,
        2,
        rounds=2,
        sync_every=4,
        checkpoint_every=0,
        eval_every=0,
        **{
            "exchange.keep_rounds": 1,
            "exchange.fragments": 2,
            "exchange.fragment_sync_delay": 1,
            "exchange.codec": '"int8"',
            "exchange.error_feedback": "true",
        },
    )
    results = _train(url, [0, 1])
    _assert_equal(_globals(results[0][1]), _globals(results[1][1]))
    metrics = read_metrics(ObjectStore(url), rank=0)
    assert [m["fragment"] for m in metrics] == [0, 1, 0, 1] and all(m["inner_steps"] == 2 for m in metrics)
    store = ObjectStore(url)
    assert ckpt.find_latest_checkpoint(store) == 3
    assert {k.split("/")[1] for k in store.list("rounds/")} == {"00000003"}, "rounds before the checkpoint were pruned"


def test_a_diverging_replica_abstains_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's loss turns NaN in round 1: it takes no step, does not contribute, says why in its heartbeat
    and metrics, restarts its inner optimizer from the new global parameters; the run finishes with both
    replicas identical and finite (before: FloatingPointError killed the replica)."""
    import dataclasses

    from diloco_serverless.trainer import loop

    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 2, rounds=3, min_replicas=1)
    who = threading.local()
    real = loop.compose_loss
    calls: dict[int, int] = {0: 0, 1: 0}

    def diverging(model: torch.nn.Module, batch: dict, **kw: object):  # type: ignore[no-untyped-def]
        comps = real(model, batch, **kw)
        rank = getattr(who, "rank", 0)
        calls[rank] += 1
        if rank == 1 and calls[rank] == 3:  # inner step 3 = the first step of round 1 (H=2)
            return dataclasses.replace(comps, total=comps.total * float("nan"))
        return comps

    monkeypatch.setattr(loop, "compose_loss", diverging)
    out: dict[int, tuple[TrainResult, ReplicaTrainer]] = {}
    beats: dict[int, list[str | None]] = {0: [], 1: []}

    def work(rank: int) -> None:
        who.rank = rank
        trainer = ReplicaTrainer.from_run(url, rank)
        original = trainer._heartbeat

        def spy(state: str, **kw: object) -> None:
            original(state, **kw)  # type: ignore[arg-type]
            beats[rank].append(trainer._note)

        trainer._heartbeat = spy  # type: ignore[method-assign]
        out[rank] = (trainer.run(), trainer)

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(out) == {0, 1}
    (r0, t0), (r1, t1) = out[0], out[1]
    _assert_equal(_globals(t0), _globals(t1))
    assert all(torch.isfinite(v).all() for v in _globals(t0).values())
    assert r0.rounds == r1.rounds == 3
    assert t1.abstentions == 1 and t0.abstentions == 0
    assert any(n and n.startswith("abstained from round 1: loss is nan") for n in beats[1])
    metrics = {m["outer_round"]: m for m in read_metrics(ObjectStore(url), 1)}
    assert metrics[1]["abstained"].startswith("loss is nan at inner step 2")
    assert metrics[0]["abstained"] is None and metrics[2]["abstained"] is None
    assert [m["participants"] for m in sorted(read_metrics(ObjectStore(url), 0), key=lambda m: m["outer_round"])] == [
        [0, 1], [0], [0, 1]
    ]


def test_a_crashed_replica_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With checkpoint_every=1, a replica killed mid-round restores its own inner optimizer, RNG and data
    position and re-trains the round: the run ends with the same bits as the run without the crash
    (before: the restarted replica reset its AdamW state and the final model differed)."""
    data = write_jsonl(tmp_path / "data.jsonl")
    ref_url = create_tiny_run(f"file://{tmp_path}/ref", data, 2, rounds=3, checkpoint_every=1)
    crash_url = create_tiny_run(f"file://{tmp_path}/crash", data, 2, rounds=3, checkpoint_every=1)
    reference = run_two_with_crash(ref_url, None, monkeypatch)
    # replicas in threads share torch's global RNG, so their random init races; start both runs from
    # the same stored initial parameters (real replica processes do not share an RNG)
    initial = ObjectStore(ref_url).get(ckpt.INITIAL_KEY)
    ObjectStore(crash_url).put(ckpt.INITIAL_KEY, initial)
    crashed = run_two_with_crash(crash_url, 6, monkeypatch)  # H=2: the 2nd inner step of round 2
    # the restart restored its own state, re-trained from there and, once at the round no one had finished
    # yet, went back to live rounds (which skip the store probe before the next round)
    assert crashed[1].attempt == 1 and not crashed[1].manager.retrain_own_rounds
    for rank in (0, 1):
        _assert_equal(_globals(crashed[rank]), _globals(reference[rank]))
    store = ObjectStore(crash_url)
    assert ckpt.load_replica_state(store, 1, 1) is not None


def test_failed_cleanup_never_stops_a_replica(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a store error while pruning old rounds crashed the replica with exit code 2."""
    from diloco_serverless.store.errors import StoreUnavailable

    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 2, rounds=3, checkpoint_every=1)
    real = ckpt.prune_checkpoints
    failures: list[int] = []

    def flaky(store: ObjectStore, keep_from_round: int) -> None:
        if not failures:
            failures.append(keep_from_round)
            raise StoreUnavailable(f"{store.url}: delete timed out", url=store.url)
        real(store, keep_from_round)

    monkeypatch.setattr(ckpt, "prune_checkpoints", flaky)
    results = _train(url, [0, 1])
    assert failures and sum(t.prune_failures for _, t in results.values()) == 1
    _assert_equal(_globals(results[0][1]), _globals(results[1][1]))
    assert ckpt.complete_rounds(ObjectStore(url)) == [1, 2]  # the next checkpoint pruned what the failed one left


def test_the_replica_uses_the_runs_store_deadline(tmp_path: Path) -> None:
    """Before: every replica store operation had a fixed 300 s deadline whatever the config said."""
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 2, store_timeout_s=7)
    trainer = ReplicaTrainer.from_run(url, 0)
    try:
        assert trainer.store.retry.timeout_s == 7.0
    finally:
        trainer.manager.shutdown()


def test_a_replica_back_before_the_first_checkpoint_re_trains_its_rounds(finished_run, tmp_path: Path) -> None:
    """With no checkpoint at all, a restarted replica knows its exact state (the run's start), so it
    does not replay the rounds it took part in: the loop re-trains them, bit for bit."""
    url, _ = finished_run
    copy = tmp_path / "copy" / "run-test"
    shutil.copytree(url.removeprefix("file://"), copy)
    for p in (copy / "checkpoints").glob("0*"):
        shutil.rmtree(p)
    trainer = ReplicaTrainer.from_run(f"file://{copy}", 1)
    assert trainer.heal() == 0 and trainer.manager.retrain_own_rounds
    trainer.manager.shutdown()


def test_the_store_is_asked_before_a_round_only_when_the_others_may_be_ahead(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before each round a replica asks the store whether the others finished it without it (catch-up: the
    round's quorum, then its votes, in sequence). After a round it took part in live they cannot have: the
    question is asked at the start (heal, then the first round, where the replica also leaves re-training)
    and not before rounds 1 and 2; the run still ends identical on both replicas."""
    from diloco_serverless.trainer.diloco import DiLoCoReplica

    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 2, rounds=3)
    asked: dict[int, list[int]] = {0: [], 1: []}
    real = DiLoCoReplica.catch_up

    def counting(self: DiLoCoReplica, limit_round: int | None = None) -> int:
        asked[self.manager.rank].append(self.manager.current_step())
        return real(self, limit_round)

    monkeypatch.setattr(DiLoCoReplica, "catch_up", counting)
    results = _train(url, [0, 1])
    assert asked == {0: [0, 0], 1: [0, 0]}, "asked at heal and before round 0 only"
    assert all(not t.manager.retrain_own_rounds and t.trained == 3 for _, t in results.values())
    _assert_equal(_globals(results[0][1]), _globals(results[1][1]))
